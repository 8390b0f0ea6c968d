"""LoRA (peft) on the real tiny Llama: reference = adapter disabled, frozen base, save/load,
merged model, PPO head + adapter, and `rlctl train model.lora.enabled=true` end to end."""
import copy
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")

from rlctl.models.forward import learner_forward# noqa: E402
from rlctl.models.lora import (AdapterDisabledReference, apply_lora, count_parameters,  # noqa: E402
                               linear_module_names, reference_for, save_lora)
from rlctl.models.value import VALUE_HEAD_FILE, PolicyValueModel  # noqa: E402
from rlctl.rollout.generate import generate  # noqa: E402
from rlctl.sinks.jsonl import read_jsonl  # noqa: E402

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["3 1 2 =", "9 =", "5 4 8 7 =", "0 6 6 1 2 ="]


def _lora(tiny, r=8, targets=ALL):
    """A LoRA policy on a private copy of the session model (get_peft_model edits in place)."""
    return apply_lora(copy.deepcopy(tiny[0]), r=r, alpha=16, dropout=0.0, target_modules=targets)


@pytest.fixture(scope="module")
def batch(tiny):
    """Left-padded prompts + sampled completions, shaped like a rollout."""
    model, tok = tiny
    torch.manual_seed(0)
    seqs, prompt_mask, plen = generate(model, tok, PROMPTS * 2, max_new_tokens=6, do_sample=True)
    mask = torch.ones_like(seqs)
    mask[:, :plen] = prompt_mask
    assert seqs.shape[1] > plen + 2
    return seqs, mask, plen


def _logp(model, batch):
    seqs, mask, plen = batch
    with torch.no_grad():
        return learner_forward(model, seqs, mask, plen).logp


def _train(model, batch, steps=5, lr=1e-2, weight_decay=0.1, critic_loss=False):
    """A few AdamW steps (optimizer over *all* parameters, as the Trainer builds it):
    raise the log-likelihood of the batch, plus a value loss for a PolicyValueModel."""
    seqs, mask, plen = batch
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        f = learner_forward(model, seqs, mask, plen)
        m = mask[:, plen:].float()
        loss = -(f.logp * m).sum() / m.sum()
        if critic_loss:
            loss = loss + ((f.values - 1.0) ** 2 * m).sum() / m.sum()
        loss.backward()
        opt.step()
    model.eval()
    return model


@pytest.fixture(scope="module")
def trained(tiny, batch):
    """(LoRA policy after 5 AdamW steps, its non-adapter weights before training)."""
    policy = _lora(tiny)
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n}
    return _train(policy, batch), before


# ---- apply_lora ---------------------------------------------------------------------
def test_apply_lora_freezes_the_base(tiny):
    policy = _lora(tiny)
    base_total = sum(p.numel() for p in tiny[0].parameters())
    trainable, total = count_parameters(policy)
    names = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert names and all("lora_A" in n or "lora_B" in n for n in names)
    # r * (in + out) per adapted Linear: 2 layers x (4 attn 128x128 + 3 MLP 128<->256)
    h, i, layers = 128, 256, tiny[0].config.num_hidden_layers
    assert trainable == layers * 8 * (4 * (h + h) + 3 * (h + i))
    assert total - trainable == base_total
    assert all(torch.count_nonzero(p) == 0 for n, p in policy.named_parameters() if "lora_B" in n)


def test_apply_lora_says_nothing_of_transformers_deprecations(tiny):
    # peft 0.21 reads PreTrainedModel.is_gradient_checkpointing, a FutureWarning a user cannot act on
    assert hasattr(type(tiny[0]), "is_gradient_checkpointing"), "the property this guards is gone"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _lora(tiny)
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(r=0), "r=0"), (dict(r=-4), "r=-4"), (dict(alpha=0), "alpha"),
    (dict(dropout=1.0), "dropout"), (dict(target_modules=[]), "empty"),
    (dict(target_modules=["q_proj", "query"]), "['query']"),
    (dict(target_modules=["c_attn"]), "['c_attn']"),
])
def test_apply_lora_rejects_bad_values(tiny, kwargs, message):
    args = dict(r=8, alpha=16, dropout=0.0, target_modules=["q_proj"], **{})
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        apply_lora(copy.deepcopy(tiny[0]), **args)
    assert message in str(err.value)
    if "target_modules" in kwargs:  # the message lists the valid names
        for name in ALL:
            assert name in str(err.value)
        assert linear_module_names(tiny[0]) == sorted(ALL + ["lm_head"])


def test_apply_lora_refuses_a_peft_model(tiny):
    with pytest.raises(ValueError, match="already"):
        apply_lora(_lora(tiny), r=4, alpha=8, dropout=0.0, target_modules=["q_proj"])


# ---- reference policy ---------------------------------------------------------------
def test_at_init_policy_equals_reference_equals_base(tiny, batch):
    policy = _lora(tiny).eval()
    base = _logp(tiny[0], batch)
    torch.testing.assert_close(_logp(policy, batch), base, rtol=0, atol=1e-6)
    torch.testing.assert_close(_logp(reference_for(policy), batch), base, rtol=0, atol=1e-6)


def test_reference_is_the_base_after_training(tiny, batch, trained):
    policy, _ = trained
    assert max(p.abs().max().item() for n, p in policy.named_parameters() if "lora_B" in n) > 0
    base = _logp(tiny[0], batch)
    ref = reference_for(policy)
    m = batch[1][:, batch[2]:].bool()
    torch.testing.assert_close(_logp(ref, batch)[m], base[m], rtol=0, atol=1e-5)
    adapted = _logp(policy, batch)
    assert (adapted[m] - base[m]).abs().max() > 1e-2       # the adapter did change the policy
    # the adapter is back on after the reference forward, and modes are restored
    torch.testing.assert_close(_logp(policy, batch), adapted, rtol=0, atol=0)
    policy.train()
    ref(input_ids=batch[0], attention_mask=batch[1])
    assert policy.training
    policy.eval()


def test_only_adapter_parameters_change(trained):
    policy, before = trained
    after = dict(policy.named_parameters())
    assert sum(t.numel() for t in before.values()) == sum(
        p.numel() for n, p in after.items() if "lora_" not in n)
    for name, old in before.items():                      # every base weight, exactly
        assert torch.equal(after[name], old), name
    moved = [n for n, p in after.items() if "lora_B" in n and torch.count_nonzero(p) > 0]
    assert len(moved) == sum(1 for n in after if "lora_B" in n)


def test_lean_adapters_are_the_peft_forward_in_float64(trained, batch):
    """apply_lora's adapters are lean (one addmm for the adapter's product, scale and add):
    against peft's own forward, a trained adapter (B != 0, scale 2) in float64 gives the same
    logits without grad and the same logits and gradients with grad, to float64 rounding
    (~1e-16 relative; a missing scale or adapter is off by O(1e-2)); adapters switched off
    give the base."""
    lean = copy.deepcopy(trained[0]).double()
    ref = copy.deepcopy(lean)
    layers = [m for m in ref.modules() if isinstance(m, peft.tuners.lora.layer.Linear)]
    assert len(layers) == 7 * 2 and all(type(m).__name__ == "_LeanLinear" for m in layers)
    for m in layers:
        m.__class__ = peft.tuners.lora.layer.Linear
    seqs, mask, _ = batch
    out = {}
    for name, model in (("lean", lean), ("peft", ref)):
        with torch.no_grad():
            plain = model(input_ids=seqs, attention_mask=mask).logits
        logits = model(input_ids=seqs, attention_mask=mask).logits
        logits.square().mean().backward()
        out[name] = plain, logits, [p.grad for p in model.parameters() if p.grad is not None]
        with torch.no_grad(), model.disable_adapter():
            out[name] += (model(input_ids=seqs, attention_mask=mask).logits,)
    (a0, a1, ga, a2), (b0, b1, gb, b2) = out["lean"], out["peft"]
    for a, b in [(a0, b0), (a1, b1), (a2, b2), *zip(ga, gb)]:
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert len(ga) == 2 * len(layers) and (a2 - a0).abs().max() > 1e-3


def test_lean_adapters_leave_a_biased_or_hooked_adapter_to_peft(trained, batch):
    """A bias on B (peft's lora_bias) and forward hooks (user code, ZeRO-3's weight gathering)
    take peft's own forward: with a bias on B the lean product would drop it (the logits
    differ by O(1)), and a hook keeping base_layer's output would see the adapter added into
    it in place."""
    from rlctl.models.lora import _not_plain
    model = copy.deepcopy(trained[0]).double()
    layers = [m for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear)]
    name = layers[0].active_adapters[0]
    assert not any(_not_plain(m, name) for m in layers)
    seqs, mask, _ = batch
    with torch.no_grad():
        before = model(input_ids=seqs, attention_mask=mask).logits
    kept = []
    hook = layers[0].base_layer.register_forward_hook(lambda m, a, out: kept.append((out, out.clone())))
    assert _not_plain(layers[0], name) and not _not_plain(layers[1], name)
    with torch.no_grad():
        model(input_ids=seqs, attention_mask=mask)
    assert kept and all(torch.equal(out, copy_) for out, copy_ in kept)    # untouched after the hook
    hook.remove()
    for m in layers:                             # a bias on every B, as lora_bias=True adds
        b = m.lora_B[name]
        b.bias = torch.nn.Parameter(torch.full((b.out_features,), 0.5, dtype=torch.float64))
    assert all(_not_plain(m, name) for m in layers)
    with torch.no_grad():
        lean = model(input_ids=seqs, attention_mask=mask).logits
        for m in layers:
            m.__class__ = peft.tuners.lora.layer.Linear
        ref = model(input_ids=seqs, attention_mask=mask).logits
    torch.testing.assert_close(lean, ref, atol=1e-12, rtol=1e-12)
    assert (lean - before).abs().max() > 1e-3


def test_a_lean_lora_model_pickles_by_name():
    """The swapped layers' class is found by name when unpickled (another process, torch.save):
    the same class and the same logits after a round trip (a model fresh from loading: after a
    forward, transformers' own output-capturing hooks are local functions that do not pickle)."""
    import pickle
    from rlctl.models.loading import load_model_and_tokenizer
    model = apply_lora(load_model_and_tokenizer("tiny")[0], r=4, alpha=8, dropout=0.0,
                       target_modules="all-linear")
    ids = torch.tensor([[1, 2, 3, 4]])
    back = pickle.loads(pickle.dumps(model))
    assert {type(m).__name__ for m in back.modules()} >= {"_LeanLinear"}
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits,
                                   atol=0, rtol=0)


def test_reference_adds_no_parameters(tiny):
    policy = _lora(tiny)
    n_params = len(list(policy.parameters()))
    counts = count_parameters(policy)
    ref = reference_for(policy)
    assert isinstance(ref, AdapterDisabledReference) and ref.peft_model is policy
    assert list(ref.parameters()) == [] and list(ref.children()) == [] and ref.state_dict() == {}
    assert len(list(policy.parameters())) == n_params and count_parameters(policy) == counts
    # both in one container: nothing is registered twice, nothing added
    both = nn.ModuleDict({"policy": policy, "ref": ref})
    assert count_parameters(both) == counts
    ids = [id(m) for _, m in both.named_modules(remove_duplicate=False)]
    assert len(ids) == len(set(ids))
    assert all(p.requires_grad is False or "lora_" in n for n, p in policy.named_parameters())


def test_reference_for_a_policy_value_model_and_errors(tiny, batch):
    pv = PolicyValueModel(_lora(tiny))
    counts = count_parameters(pv)
    ref = reference_for(pv)
    assert ref.peft_model is pv.policy and count_parameters(pv) == counts
    torch.testing.assert_close(_logp(ref, batch), _logp(tiny[0], batch), rtol=0, atol=1e-5)
    with pytest.raises(TypeError):
        reference_for(tiny[0])


# ---- saving -----------------------------------------------------------------------
def test_save_lora_reloads_and_merged_matches(tiny, tiny_dir, batch, trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy, _ = trained
    want = _logp(policy, batch)
    out = save_lora(policy, tmp_path / "model", tiny[1], merged=True)
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json",
                 "merged/model.safetensors", "merged/config.json", "merged/tokenizer.json"):
        assert (out / name).is_file(), name
    assert not (out / "model.safetensors").exists()       # the adapter only, not the base
    assert (out / "adapter_model.safetensors").stat().st_size < \
        (out / "merged" / "model.safetensors").stat().st_size / 4
    assert any("lora_" in n for n, _ in policy.named_parameters())  # live model not merged
    torch.testing.assert_close(_logp(policy, batch), want, rtol=0, atol=0)

    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    reloaded = PeftModel.from_pretrained(base, out).eval()
    torch.testing.assert_close(_logp(reloaded, batch), want, rtol=0, atol=1e-6)

    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    seqs, mask, _ = batch
    with torch.no_grad():
        a = merged(input_ids=seqs, attention_mask=mask).logits
        b = policy(input_ids=seqs, attention_mask=mask).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert (b - tiny[0](input_ids=seqs, attention_mask=mask).logits).abs().max() > 1e-2
    assert len(AutoTokenizer.from_pretrained(out / "merged")) == len(tiny[1])


# ---- PPO: value head on a LoRA policy -------------------------------------------------
def test_policy_value_model_trains_head_and_adapter_only(tiny, batch, tmp_path):
    pv = PolicyValueModel(_lora(tiny))
    trainable, total = count_parameters(pv)
    assert trainable == count_parameters(pv.policy)[0] + 128 + 1
    before = {n: p.detach().clone() for n, p in pv.named_parameters()}
    _train(pv, batch, steps=3, critic_loss=True)
    moved = {n for n, p in pv.named_parameters() if not torch.equal(p, before[n])}
    assert {"value_head.summary.weight", "value_head.summary.bias"} <= moved
    assert any("lora_A" in n for n in moved) and any("lora_B" in n for n in moved)
    assert all("lora_" in n or n.startswith("value_head.") for n in moved), moved
    out = save_lora(pv, tmp_path / "model", tiny[1])
    assert (out / VALUE_HEAD_FILE).is_file() and (out / "adapter_config.json").is_file()


def test_ppo_trainer_with_lora_reference(tiny):
    """The real Trainer: PPO (shared critic) on a LoRA policy, KL to the adapter-disabled
    reference; after two steps only the adapter and the value head have moved."""
    from omegaconf import OmegaConf

    from rlctl.config.compose import compose
    from rlctl.train.sources import build_source
    from rlctl.train.trainer import Trainer
    from rlctl.train.build import prepare_task
    from rlctl.sinks import NullSink

    cfg = compose(["algo=ppo", "model.lora.enabled=true", "algo.kl.coef=0.05",
                   "trainer.prompts_per_step=2", "algo.group_size=4", "trainer.eval_every=0",
                   "trainer.lr=1e-3"]).cfg
    OmegaConf.resolve(cfg)
    task = prepare_task(cfg, tiny[1], tiny[0], quiet=True)   # as rlctl train prepares it
    torch.manual_seed(0)
    lc = cfg.model.lora
    pv = PolicyValueModel(apply_lora(copy.deepcopy(tiny[0]), lc.r, lc.alpha, lc.dropout,
                                     list(lc.target_modules)))
    before = {n: p.detach().clone() for n, p in pv.named_parameters()}
    tr = Trainer.from_config(cfg, pv, tiny[1], task, NullSink(),
                             source=build_source(cfg, pv, tiny[1], task), ref_model=reference_for(pv))
    assert isinstance(tr.ref_model, AdapterDisabledReference)
    seen, prepare = [], tr._prepare
    tr._prepare = lambda b, prompts: seen.append(prepare(b, prompts)) or seen[-1]
    tr.step(1)
    tr.step(2)
    for i, b in enumerate(seen):                 # the reference is the base at every step
        m = b.mask.bool()
        base = learner_forward(tiny[0], b.input_ids, b.attention_mask, b.prompt_len).logp
        torch.testing.assert_close(b.logprobs.ref[m], base.detach()[m], rtol=0, atol=1e-5)
        gap = (b.logprobs.old[m] - b.logprobs.ref[m]).abs().max()
        assert gap < 1e-6 if i == 0 else gap > 1e-3   # B = 0 before the first update
    moved = {n for n, p in pv.named_parameters() if not torch.equal(p, before[n])}
    assert "value_head.summary.weight" in moved and any("lora_B" in n for n in moved)
    assert all("lora_" in n or n.startswith("value_head.") for n in moved), moved


# ---- end to end through the console script ---------------------------------------------
def test_rlctl_train_with_lora_end_to_end(tiny, tiny_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [RLCTL, "train", "model.lora.enabled=true", "algo.kl.coef=0.05", "trainer.steps=3",
            "model.lora.save_merged=true", f"model.cache_dir={tiny_dir.parent}",
            "logger=jsonl", f"run.output_dir={tmp_path}", "trainer.eval_every=3",
            "task.num_eval=16", "trainer.prompts_per_step=4", "algo.group_size=4",
            "trainer.lr=1e-3"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    run = sorted(p for p in tmp_path.iterdir() if p.is_dir())[-1]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    kl = [r["policy/kl_ref"] for r in rows[1:]]
    assert all(math.isfinite(k) for k in kl)
    assert abs(kl[0]) < 1e-6 and kl[-1] > 0        # B = 0 at step 1, then the adapter moves
    summary = json.loads((run / "summary.json").read_text())
    assert summary["lora"] is True
    assert 0 < summary["params_trainable"] < summary["params_total"] / 5
    model_dir = run / "model"
    assert (model_dir / "adapter_model.safetensors").is_file()
    assert not (model_dir / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    adapted = PeftModel.from_pretrained(base, model_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(model_dir / "merged").eval()
    ids = tiny[1](PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        a = adapted(**ids).logits
        b = merged(**ids).logits
        with adapted.disable_adapter():
            c = adapted(**ids).logits
        d = tiny[0](**ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(c, d, rtol=0, atol=1e-5)   # the run kept its base frozen
    assert (a - d).abs().max() > 1e-4                     # and trained the adapter


def test_lora_off_by_default_summary(tmp_path, tiny_dir):
    from rlctl.train.run import run_training

    summary = run_training([f"run.output_dir={tmp_path}", f"model.cache_dir={tiny_dir.parent}",
                            "trainer.steps=1", "trainer.eval_every=0", "logger=none",
                            "trainer.prompts_per_step=2", "algo.group_size=2",
                            "logger.console=false"])
    assert summary["lora"] is False
    assert summary["params_trainable"] == summary["params_total"] > 0
    assert (Path(summary["model_dir"]) / "model.safetensors").is_file()


def test_bad_lora_target_is_a_user_error(tmp_path, tiny_dir):
    from rlctl.train.run import run_training
    from rlctl.errors import UserError

    with pytest.raises(UserError, match="valid: .*q_proj"):
        run_training([f"run.output_dir={tmp_path}", f"model.cache_dir={tiny_dir.parent}",
                      "model.lora.enabled=true", "model.lora.target_modules=[qproj]",
                      "trainer.steps=1", "logger=none"])


def test_run_training_passes_the_adapter_disabled_reference(tmp_path, tiny_dir, monkeypatch):
    """run.py hands the Trainer the adapter-disabled reference (no deep copy of the policy)."""
    from rlctl.train import trainer as trainer_mod
    from rlctl.train.run import run_training

    seen = {}
    init = trainer_mod.Trainer.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen["ref"], seen["model"] = self.ref_model, self.model
    monkeypatch.setattr(trainer_mod.Trainer, "__init__", spy)
    summary = run_training([f"run.output_dir={tmp_path}", f"model.cache_dir={tiny_dir.parent}",
                            "model.lora.enabled=true", "algo.kl.coef=0.05", "algo=ppo",
                            "trainer.steps=1", "trainer.eval_every=0", "logger=none",
                            "trainer.prompts_per_step=2", "algo.group_size=2",
                            "logger.console=false"])
    assert isinstance(seen["ref"], AdapterDisabledReference)
    assert seen["ref"].peft_model is seen["model"].policy
    model_dir = Path(summary["model_dir"])
    assert (model_dir / VALUE_HEAD_FILE).is_file() and (model_dir / "adapter_config.json").is_file()
    assert not (model_dir / "merged").exists()
