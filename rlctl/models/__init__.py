"""Models: the embedded tiny Llama (built and cached locally) and HF loading."""
from rlctl.models.loading import load_model_and_tokenizer

__all__ = ["load_model_and_tokenizer"]
