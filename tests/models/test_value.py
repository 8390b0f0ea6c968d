"""Value head / critic on the real tiny Llama: alignment, gradients, save/load, generate."""
import copy

import pytest
import torch
from safetensors.torch import load_file

from rlctl.models.forward import learner_forward
from rlctl.models.kv_share import position_ids_from_mask
from rlctl.models.value import VALUE_HEAD_FILE, PolicyValueModel, SeparateCritic
from rlctl.rollout.generate import generate

PROMPTS = ["3 1 2 =", "9 =", "5 4 8 7 ="]


@pytest.fixture()
def policy(tiny):
    """A private copy of the session model (tests backpropagate into it)."""
    return copy.deepcopy(tiny[0]).eval()


@pytest.fixture(scope="module")
def batch(tiny):
    """A real rollout-shaped batch: left-padded prompts + greedy completions."""
    model, tok = tiny
    seqs, prompt_mask, plen = generate(model, tok, PROMPTS, max_new_tokens=4, do_sample=False)
    mask = torch.ones_like(seqs)
    mask[:, :plen] = prompt_mask
    assert plen >= 3 and seqs.shape[1] > plen + 1
    return seqs, mask, plen


def _inputs(seqs, mask):
    """What the learner feeds: the sequence minus its last token, positions skip padding."""
    ids, am = seqs[:, :-1], mask[:, :-1]
    return dict(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am))


def test_last_hidden_state_is_the_normed_one_the_lm_head_reads(policy, batch):
    out = policy(**_inputs(*batch[:2]), output_hidden_states=True, use_cache=False)
    assert len(out.hidden_states) == policy.config.num_hidden_layers + 1
    torch.testing.assert_close(policy.lm_head(out.hidden_states[-1]), out.logits, rtol=0, atol=0)
    base = policy.model(**_inputs(*batch[:2]), use_cache=False).last_hidden_state
    torch.testing.assert_close(out.hidden_states[-1], base, rtol=0, atol=0)


def test_one_forward_gives_policy_logits_and_values(policy, batch):
    seqs, mask, _ = batch
    pv = PolicyValueModel(policy, init_std=0.1).eval()
    with torch.no_grad():
        out = pv(**_inputs(seqs, mask))
        plain = policy(**_inputs(seqs, mask), use_cache=False).logits
        hidden = policy.model(**_inputs(seqs, mask), use_cache=False).last_hidden_state
    n, L = seqs.shape[0], seqs.shape[1] - 1
    assert out.logits.shape == plain.shape and out.values.shape == (n, L)
    assert out.values.dtype == torch.float32
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.values, hidden @ pv.value_head.summary.weight[0]
                               + pv.value_head.summary.bias, rtol=0, atol=1e-5)
    assert out.values.std() > 0


def test_zero_init_values_and_interface(policy, batch):
    pv = PolicyValueModel(policy)
    with torch.no_grad():
        assert torch.count_nonzero(pv(**_inputs(*batch[:2])).values) == 0
    assert pv.config is policy.config and pv.generation_config is policy.generation_config
    assert pv.dtype == torch.float32 and pv.device.type == "cpu"
    ids = {id(p) for p in pv.parameters()}
    assert all(id(p) in ids for p in pv.value_head.parameters())
    assert all(id(p) in ids for p in policy.parameters())
    pv.train()
    assert policy.training and pv.value_head.training
    pv.eval()
    assert not policy.training and not pv.value_head.training


def _value_loss(values, seqs, mask, plen):
    target = torch.linspace(-1, 1, values.shape[0])[:, None]
    v = values[:, plen - 1:]                      # [N, T]: V(s_t), s_t = prompt + t tokens
    return ((v - target) ** 2 * mask[:, plen:]).sum() / mask[:, plen:].sum()


def _grad_norm(params):
    grads = [p.grad for p in params if p.grad is not None]
    return sum(g.abs().sum().item() for g in grads) if grads else None


def test_shared_value_loss_trains_head_and_backbone(policy, batch):
    seqs, mask, plen = batch
    pv = PolicyValueModel(policy)  # zero head: backbone gradient is exactly zero at first
    _value_loss(pv(**_inputs(seqs, mask)).values, seqs, mask, plen).backward()
    assert _grad_norm(pv.value_head.parameters()) > 0
    assert _grad_norm(policy.model.parameters()) == 0.0
    pv.zero_grad(set_to_none=True)
    pv = PolicyValueModel(policy, init_std=0.1)
    _value_loss(pv(**_inputs(seqs, mask)).values, seqs, mask, plen).backward()
    assert _grad_norm(pv.value_head.parameters()) > 0
    assert _grad_norm(policy.model.layers.parameters()) > 0
    assert _grad_norm(policy.model.embed_tokens.parameters()) > 0


def test_separate_critic_is_a_detached_copy(policy, batch):
    seqs, mask, plen = batch
    critic = SeparateCritic(policy, init_std=0.1)
    shared = PolicyValueModel(policy)
    shared.value_head.load_state_dict(critic.value_head.state_dict())
    with torch.no_grad():  # same weights -> same values as the shared layout
        torch.testing.assert_close(critic(**_inputs(seqs, mask)),
                                   shared(**_inputs(seqs, mask)).values)
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in critic.parameters()}
    assert not hasattr(critic.backbone, "lm_head")
    _value_loss(critic(**_inputs(seqs, mask)), seqs, mask, plen).backward()
    assert all(p.grad is None for p in policy.parameters())
    assert _grad_norm(critic.value_head.parameters()) > 0
    assert _grad_norm(critic.backbone.parameters()) > 0


def _load_head(head, directory):
    """A saved ``value_head.safetensors`` into ``head``."""
    head.load_state_dict(load_file(directory / VALUE_HEAD_FILE))


def test_save_load_round_trip(policy, batch, tmp_path):
    from transformers import AutoModel, AutoModelForCausalLM

    seqs, mask, _ = batch
    pv = PolicyValueModel(policy, init_std=0.1).eval()
    pv.save_pretrained(tmp_path / "pv")
    assert (tmp_path / "pv" / VALUE_HEAD_FILE).is_file()
    pv2 = PolicyValueModel(AutoModelForCausalLM.from_pretrained(tmp_path / "pv")).eval()
    with torch.no_grad():
        assert torch.count_nonzero(pv2(**_inputs(seqs, mask)).values) == 0  # before loading
        _load_head(pv2.value_head, tmp_path / "pv")
        a, b = pv(**_inputs(seqs, mask)), pv2(**_inputs(seqs, mask))
    torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)

    critic = SeparateCritic(policy, init_std=0.1).eval()
    critic.save_pretrained(tmp_path / "critic")
    critic2 = SeparateCritic(backbone=AutoModel.from_pretrained(tmp_path / "critic")).eval()
    _load_head(critic2.value_head, tmp_path / "critic")
    with torch.no_grad():
        torch.testing.assert_close(critic(**_inputs(seqs, mask)), critic2(**_inputs(seqs, mask)),
                                   rtol=0, atol=0)


def test_learner_values_are_the_value_of_prompt_plus_first_t_tokens(policy, batch):
    """learner_forward's values[:, t] equal the head on the hidden state of prompt + the
    first t completion tokens, each prefix run on its own."""
    seqs, mask, plen = batch
    T = seqs.shape[1] - plen
    pv = PolicyValueModel(policy, init_std=0.1).eval()
    with torch.no_grad():
        v = learner_forward(pv, seqs, mask, plen).values
        assert v.shape == (seqs.shape[0], T)
        for t in range(T):  # s_t = prompt + first t completion tokens, run on its own
            ids, am = seqs[:, :plen + t], mask[:, :plen + t]
            hidden = policy.model(input_ids=ids, attention_mask=am, use_cache=False,
                                  position_ids=position_ids_from_mask(am)).last_hidden_state
            torch.testing.assert_close(v[:, t], pv.value_head(hidden[:, -1]), rtol=0, atol=1e-5)


def test_generate_through_wrapper(policy, tiny):
    tok = tiny[1]
    pv = PolicyValueModel(policy).eval()
    a = generate(pv, tok, PROMPTS, max_new_tokens=4, do_sample=False)[0]
    b = generate(policy, tok, PROMPTS, max_new_tokens=4, do_sample=False)[0]
    assert torch.equal(a, b) and a.shape[1] > len(tok(PROMPTS[2])["input_ids"])


def test_lora_policy_keeps_head_trainable(policy, batch, tmp_path):
    peft = pytest.importorskip("peft")
    seqs, mask, plen = batch
    lora = peft.get_peft_model(policy, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    pv = PolicyValueModel(lora, init_std=0.1)
    trainable = {n for n, p in pv.named_parameters() if p.requires_grad}
    assert {"value_head.summary.weight", "value_head.summary.bias"} <= trainable
    assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)
    _value_loss(pv(**_inputs(seqs, mask)).values, seqs, mask, plen).backward()
    assert _grad_norm(pv.value_head.parameters()) > 0
    assert _grad_norm(p for n, p in pv.named_parameters() if "lora_B" in n) > 0
    pv.save_pretrained(tmp_path / "lora")
    assert (tmp_path / "lora" / "adapter_config.json").is_file()
    assert (tmp_path / "lora" / VALUE_HEAD_FILE).is_file()
    critic = SeparateCritic(lora)  # adapters merged away; full copy, all trainable
    assert not any("lora_" in n for n, _ in critic.named_parameters())
    assert all(p.requires_grad for p in critic.parameters())
