"""Models: loading (HF directories, GGUF, LoRA), the learner forward, the value head and critic, the shared prompt KV cache, stop ids."""
