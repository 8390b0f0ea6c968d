"""Models: loading, LoRA, the learner forward, value head and critic, KV sharing, stop ids."""
