"""A random-init Llama sequence classifier (one label) over the tiny model's tokenizer, saved
as a reward-model directory: a real checkpoint with a score head, seconds to build."""
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from rlctl.demo import tiny


def save_random_reward_model(out_dir, seed: int = 0):
    """Write the model and tokenizer to ``out_dir``; returns the tokenizer."""
    tok = tiny.build_tokenizer()
    torch.manual_seed(seed)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, num_labels=1)).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return tok
