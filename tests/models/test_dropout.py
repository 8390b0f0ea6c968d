"""``disable_dropout`` (rlctl/models/loading.py) on the ways transformers models read a
dropout probability: nn.Dropout modules (GPT-2, also its ``attn_dropout.p`` passed to the
attention function), floats kept on a module at construction (Llama's
``self.attention_dropout``), the config read at forward time (Falcon, GPT-Neo) and an
MoE router's train-only jitter (Mixtral).

Each family gets every dropout probability of its config at 0.1 (and Mixtral a router
jitter of 0.1). The check: a train-mode forward equals the eval-mode forward. Before
``disable_dropout`` they differ (so the test can fail); after it, in float64, the two are
the same computation (dropout with p = 0 keeps every unit, scaled by 1 / (1 - 0) = 1), so
the logits agree to float64 rounding: 1e-12 is far above that (2^-53 times a few hundred
roundings of O(1) values) and far below dropout's effect (> 1e-3 here)."""
import pytest
import torch
import transformers as tf

from rlctl.models.loading import disable_dropout

V, H = 97, 32
COMMON = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4)

CONFIGS = {
    "gpt2": lambda: tf.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=32),
    "llama": lambda: tf.LlamaConfig(intermediate_size=2 * H, attention_dropout=0.1, **COMMON),
    "falcon": lambda: tf.FalconConfig(attention_dropout=0.1, hidden_dropout=0.1, **COMMON),
    "gpt_neo": lambda: tf.GPTNeoConfig(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4,
                                       attention_types=[[["global", "local"], 1]],
                                       embed_dropout=0.1, attention_dropout=0.1, resid_dropout=0.1),
    "gpt_neox": lambda: tf.GPTNeoXConfig(intermediate_size=2 * H, attention_dropout=0.1,
                                         hidden_dropout=0.1, **COMMON),
    "phi3": lambda: tf.Phi3Config(intermediate_size=2 * H, attention_dropout=0.1, resid_pdrop=0.1,
                                  embd_pdrop=0.1, pad_token_id=0, **COMMON),
    "mixtral": lambda: tf.MixtralConfig(intermediate_size=2 * H, num_local_experts=4,
                                        num_key_value_heads=4, router_jitter_noise=0.1,
                                        attention_dropout=0.1, **COMMON),
}


def _logits(model, ids, train: bool):
    model.train(train)
    torch.manual_seed(1)                 # the same dropout masks for every call in a mode
    with torch.no_grad():
        return model(input_ids=ids).logits                                   # [2, L, V]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_train_forward_equals_eval_forward_after_disable_dropout(family):
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[family](), experts_implementation="eager") \
        if family == "mixtral" else tf.AutoModelForCausalLM.from_config(CONFIGS[family]())
    model.double()         # (Mixtral: the grouped-matmul experts take no float64; eager ones do)
    ids = torch.randint(V, (2, 12))                                          # [2, L]
    before = (_logits(model, ids, True) - _logits(model, ids, False)).abs().max().item()
    assert before > 1e-3, f"{family}: dropout had no effect to begin with ({before})"
    assert disable_dropout(model) > 0
    after = (_logits(model, ids, True) - _logits(model, ids, False)).abs().max().item()
    assert after < 1e-12, f"{family}: train and eval forwards differ by {after}"


def test_nested_text_config_and_count():
    """A nested config (``text_config``) is zeroed too, bools and zeros are left alone,
    and a second call has nothing left to change."""
    conf = tf.LlamaConfig(attention_dropout=0.1, **COMMON)
    model = tf.AutoModelForCausalLM.from_config(conf)
    model.config.text_config = tf.GemmaConfig(attention_dropout=0.2)
    model.config.use_dropout_flag = True
    disable_dropout(model)
    assert model.config.attention_dropout == 0.0
    assert model.config.text_config.attention_dropout == 0.0
    assert model.config.use_dropout_flag is True
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)
    assert disable_dropout(model) == 0
