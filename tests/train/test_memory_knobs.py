"""Memory knobs: trainer.micro_batch_tokens (rows packed under a padded-token budget; the
update equals one micro-batch's), model.gradient_checkpointing (same gradients, fewer
saved activations), hardware.precision=bf16 on the torch backend (autocast forward,
fp32 weights and AdamW state), and the CLI path of all three."""
import copy

import pytest
import torch

from rlctl.dist.backends import TorchBackend
from rlctl.models.forward import enable_gradient_checkpointing, learner_forward
from rlctl.train.update import (UpdateState, accumulate_gradients, activation_mb, even_split,
                                micro_batches)
from test_engine_update import MODES, _batch, _settings, tiny  # noqa: F401  (fixture reused)



def test_micro_batches_by_hand():
    """row_len [3, 7, 1, 5, 7], P = 2, budget 20: longest first (rows 1, 4, 3, 0, 2);
    [1, 4] = 2 x (2 + 7) = 18; + row 3 would be 27 -> [3, 0] = 2 x (2 + 5) = 14; + row 2
    would be 21 -> [2] = 3."""
    got = micro_batches(torch.tensor([3, 7, 1, 5, 7]), 2, tokens=20)
    assert [m.tolist() for m in got] == [[1, 4], [3, 0], [2]]
    got = micro_batches(torch.tensor([3, 7, 1, 5, 7]), 2, size=1, tokens=20)   # both limits
    assert [m.tolist() for m in got] == [[1], [4], [3], [0], [2]]
    got = micro_batches(torch.tensor([3, 7]), 2, tokens=5)                     # a row over budget: alone
    assert [m.tolist() for m in got] == [[1], [0]]
    got = micro_batches(torch.tensor([3, 7, 1]), 2, tokens=20, width=7)        # untrimmed width
    assert [m.tolist() for m in got] == [[1, 0], [2]]


def test_micro_batches_respect_the_budget():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        row_len = torch.randint(0, 30, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
        P, budget = int(torch.randint(1, 10, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
        parts = micro_batches(row_len, P, tokens=budget)
        assert sorted(torch.cat(parts).tolist()) == list(range(len(row_len)))   # each row once
        for m in parts:
            assert len(m) == 1 or len(m) * (P + max(int(row_len[m].max()), 1)) <= budget


@pytest.mark.parametrize("mode", MODES)
def test_token_budget_update_equals_one_micro_batch(tiny, mode):  # noqa: F811
    """float64 model: several budgeted micro-batches give the one-batch gradient to 1e-6.
    Not tighter because transformers runs Llama's RMSNorm in float32 even in a float64
    model, and micro-batches trimmed to other widths reduce in another order (measured
    9e-8 at most), far below the gradient's scale (its entries reach O(1))."""
    model = copy.deepcopy(tiny[0]).double()
    batch = _batch(tiny[1])
    row_len = batch.mask.sum(-1).long()
    budget = 2 * (batch.prompt_len + 5)
    assert len(micro_batches(row_len, batch.prompt_len, tokens=budget)) >= 3
    grads = []
    for tokens in (0, budget):
        s = _settings(mode, 0)
        s.micro_batch_tokens = tokens
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, TorchBackend(), batch, s, UpdateState())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-6)


def test_even_split_by_hand():
    """32 rows: 11 fit -> 3 micro-batches of 11, 11, 10; a smaller micro_batch_size wins;
    nothing fits -> rows alone; all fit -> one."""
    assert even_split(32, 0, 11) == 11 and even_split(32, 8, 11) == 8
    assert even_split(32, 0, 16) == 16 and even_split(32, 0, 17) == 16
    assert even_split(32, 0, 0) == 1 and even_split(32, 0, 99) == 32
    assert activation_mb(None, "cpu") == 768 and activation_mb(None, "cuda") == 0   # null: by device
    assert activation_mb(0, "cpu") == 0 and activation_mb(300, "cuda") == 300


def test_the_activation_budget_splits_evenly_with_the_same_update(tiny):  # noqa: F811
    """trainer.activation_mb: a budget for 4 rows of the widest's width -> 6 rows in 2 even
    micro-batches of 3 (not 4 + 2; a forward hook sees their rows), and the one-batch
    gradient (float64, to 1e-6 as above)."""
    model = copy.deepcopy(tiny[0]).double()
    batch = _batch(tiny[1])
    wide = batch.prompt_len + int(batch.mask.sum(-1).max())
    assert batch.num_sequences == 6
    grads, rows = [], []
    hook = model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    for tokens in (0, 4 * wide + 2):
        s = _settings(MODES[0], 0)
        s.activation_tokens, s.share_prompts = tokens, False
        model.zero_grad(set_to_none=True)
        rows.clear()
        accumulate_gradients(model, TorchBackend(), batch, s, UpdateState())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    hook.remove()
    assert rows == [3, 3]
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-6)


def _grads_and_saved(model, batch, share):
    """(gradients, bytes saved for backward outside checkpointed regions) of one forward +
    backward; the bytes come from a saved-tensor hook (checkpointed layers save through
    their own hooks and keep only their inputs), each tensor counted once."""
    saved = {}

    def pack(t):
        saved[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t
    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        f = learner_forward(model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                            share_prompts=share)
    (f.logp * batch.mask).sum().backward()
    return [p.grad.clone() for p in model.parameters()], sum(saved.values())


def test_gradient_checkpointing_same_gradients_less_saved(tiny):  # noqa: F811
    """Same gradients as the full forward (float64; the recomputation is the same
    arithmetic: 1e-10), also when prompt sharing is asked for (skipped under
    checkpointing: its layers would drop the cache), and fewer bytes kept for backward."""
    plain = copy.deepcopy(tiny[0]).double().train()
    ckpt = copy.deepcopy(plain)
    enable_gradient_checkpointing(ckpt)
    batch = _batch(tiny[1])
    g_plain, bytes_plain = _grads_and_saved(plain, batch, share=False)
    g_ckpt, bytes_ckpt = _grads_and_saved(ckpt, batch, share=True)
    for a, b in zip(g_ckpt, g_plain):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert bytes_ckpt < 0.7 * bytes_plain, (bytes_ckpt, bytes_plain)


def test_bf16_autocast_keeps_fp32_weights_and_adam_state(tiny):  # noqa: F811
    model = copy.deepcopy(tiny[0]).float()
    before = [p.detach().clone() for p in model.parameters()]
    backend = TorchBackend("cpu", precision="bf16")
    module = backend.prepare(model, None, 1e-2, (0.9, 0.999), 0.0, 0, 1.0)
    assert backend.unwrap() is model and module is not model
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    batch = _batch(tiny[1])
    batch.advantages = batch.advantages.float()
    accumulate_gradients(module, backend, batch, _settings("token-mean", 0), UpdateState())
    hook.remove()
    assert seen and all(d == torch.bfloat16 for d in seen)            # the forward ran in bf16
    norm = backend.step()
    assert torch.isfinite(norm) and norm > 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    state = [s for s in backend.optimizer.state.values()]
    assert state and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in state)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))   # it trained


@pytest.fixture
def train(tmp_path, rlctl_app):
    """`rlctl train` with the knobs, through the Typer app in-process."""
    return lambda *overrides: rlctl_app(
        "train", "logger=none", "trainer.steps=2", "trainer.prompts_per_step=2", "algo.group_size=2",
        "trainer.eval_every=0", "run.save_model=false", f"run.output_dir={tmp_path}", *overrides)


def test_cli_runs_with_all_three_knobs(train):
    proc = train("model.gradient_checkpointing=true", "hardware.precision=bf16",
                  "trainer.micro_batch_tokens=24")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_cli_bad_token_budget_is_one_line(train):
    proc = train("trainer.micro_batch_tokens=-1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "trainer.micro_batch_tokens" in lines[0], proc.stderr


def test_bf16_casts_a_frozen_lora_base_once_with_the_same_results(tiny):  # noqa: F811
    """LoRA under the bf16 backend: each frozen base Linear runs as one bf16 copy, made once
    (a second forward reuses it; the fp32 weight is back after each forward; a changed
    weight is cast again), with bitwise autocast's per-call log-probs and adapter gradients."""
    from rlctl.dist.backends import BF16Autocast
    from rlctl.models.lora import apply_lora

    model = apply_lora(copy.deepcopy(tiny[0]).float(), 4, 8, 0.0, "all-linear")
    with torch.no_grad():                    # B = 0 at init: make the adapters act
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    batch = _batch(tiny[1])
    runs, wrapped = {}, None
    for cached in (False, True):
        wrapped = BF16Autocast(model, "cpu")
        if not cached:
            wrapped._frozen = lambda: []      # autocast's own per-call casts
        model.zero_grad(set_to_none=True)
        f = learner_forward(wrapped, batch.input_ids, batch.attention_mask, batch.prompt_len,
                            share_prompts=True)
        (f.logp * batch.mask).sum().backward()
        runs[cached] = f.logp.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]
    (l0, g0), (l1, g1) = runs[False], runs[True]
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert any(g.abs().sum() > 0 for g in g1)
    copies = {k: v[2] for k, v in wrapped._casts.items()}
    assert len(copies) > 0 and all(c.dtype == torch.bfloat16 for c in copies.values())
    assert all(p.dtype == torch.float32 for p in model.parameters())        # restored
    wrapped(input_ids=batch.input_ids)                                       # reused
    assert all(wrapped._casts[k][2] is c for k, c in copies.items())
    w = next(p for n, p in model.named_parameters() if "base_layer.weight" in n)
    with torch.no_grad():
        w.add_(1.0)                                                          # changed: cast again
    wrapped(input_ids=batch.input_ids)
    assert torch.equal(wrapped._casts[id(w)][2], w.detach().to(torch.bfloat16))
    version = w._version
    w.data = w.data + 1.0            # a new storage through .data (moves no version counter)
    assert w._version == version
    wrapped(input_ids=batch.input_ids)
    assert torch.equal(wrapped._casts[id(w)][2], w.detach().to(torch.bfloat16))
    wrapped.release()
    assert wrapped._casts == {}
    backend = TorchBackend("cpu", precision="bf16")      # the backend drops them for generation
    module = backend.prepare(model, None, 1e-3, (0.9, 0.999), 0.0, 0, 1.0)
    module(input_ids=batch.input_ids)
    assert backend._autocast is module and len(module._casts) == len(copies)
    with backend.sampling(model):
        assert module._casts == {}


def _sizeless(model):
    """The model with a config that gives no layer count (the budget cannot be turned into rows)."""
    model.config.num_hidden_layers = 0
    return model


def test_an_activation_budget_that_cannot_apply_is_said(make_trainer, capsys):
    """An explicit trainer.activation_mb with no model sizes: one warning line on stderr naming
    the knob and why; null (the default) and 0 (no limit) say nothing."""
    for overrides, said in ((["trainer.activation_mb=300"], True), ([], False),
                            (["trainer.activation_mb=0"], False)):
        make_trainer(overrides, wrap=_sizeless)
        err = capsys.readouterr().err
        assert (("trainer.activation_mb=300 does not apply with a model config without "
                 "hidden_size / num_hidden_layers") in err) == said, (overrides, err)
    make_trainer(["trainer.activation_mb=300"])                 # sizes known: it applies, silently
    assert "activation_mb" not in capsys.readouterr().err
