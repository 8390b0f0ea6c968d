"""chunked_token_logprobs: exact to the unchunked LM head + log-softmax, in values, gradients
and memory (no [N*T, V] tensor is ever created; at most keep_elements logits are kept)."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlctl.core import chunked_token_logprobs
from rlctl.core.logprobs import default_chunk_tokens

F64 = torch.float64


def _case(n=3, t=5, hdim=4, v=11, dtype=F64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, t, hdim, generator=g, dtype=F64) * scale).to(dtype).requires_grad_(True)
    w = torch.randn(v, hdim, generator=g, dtype=F64).to(dtype).requires_grad_(True)
    b = torch.randn(v, generator=g, dtype=F64).to(dtype).requires_grad_(True)
    y = torch.randint(0, v, (n, t), generator=g)
    if n:
        y[0, 0], y[-1, -1] = 0, v - 1  # both ends of the id range (e.g. a pad id of 0)
    return h, w, b, y


def _reference(h, w, b, y, temperature):
    """The unchunked computation: full [N, T, V] logits, log_softmax, gather, entropy."""
    z = torch.nn.functional.linear(h, w, b) / temperature  # [N, T, V]
    logq = torch.log_softmax(z, dim=-1)  # [N, T, V]
    logp = logq.gather(-1, y[..., None]).squeeze(-1)  # [N, T]
    ent = -(logq.exp() * logq).sum(-1)  # [N, T]
    return logp, ent


@pytest.mark.parametrize("chunk", [1, 7, 15, 1000])  # 15 = N*T exactly; 7 leaves a remainder
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_unchunked_float64(chunk, temperature):
    h, w, b, y = _case()
    logp, ent = chunked_token_logprobs(h, w, y, b, temperature, chunk, with_entropy=True)
    ref_logp, ref_ent = _reference(h, w, b, y, temperature)
    assert logp.shape == ent.shape == (3, 5) and logp.dtype == ent.dtype == F64
    torch.testing.assert_close(logp, ref_logp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    g = torch.Generator().manual_seed(1)
    g_logp, g_ent = torch.randn(2, 3, 5, generator=g, dtype=F64)  # upstream on BOTH outputs
    got = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), (h, w, b))
    want = torch.autograd.grad((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum(), (h, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=0)


@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_gradient_of_each_output_alone(which):
    """One output unused (its upstream gradient is None): the other's gradient stands alone."""
    h, w, b, y = _case(seed=2)
    logp, ent = chunked_token_logprobs(h, w, y, b, 1.3, 4, with_entropy=True)
    ref_logp, ref_ent = _reference(h, w, b, y, 1.3)
    out, ref = (logp, ref_logp) if which == "logp" else (ent, ref_ent)
    got = torch.autograd.grad(out.sum(), (h, w, b))
    want = torch.autograd.grad(ref.sum(), (h, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=0)


def test_without_entropy_and_without_bias():
    h, w, _, y = _case(seed=3)
    logp, ent = chunked_token_logprobs(h, w, y, chunk_tokens=4)
    assert ent is None
    ref_logp, _ = _reference(h, w, None, y, 1.0)
    torch.testing.assert_close(logp, ref_logp, atol=1e-12, rtol=0)
    got = torch.autograd.grad(logp.sum(), (h, w))
    want = torch.autograd.grad(ref_logp.sum(), (h, w))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=0)


def test_gradcheck_tiny():
    h, w, b, y = _case(n=2, t=3, hdim=3, v=5, seed=4)
    fn = lambda h, w, b: chunked_token_logprobs(h, w, y, b, 0.8, 2, with_entropy=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h, w, b))


def test_tied_input_embedding_gets_both_gradients():
    """W is the input embedding too: the gradient sums the lookup's and the head's parts."""
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(9, 4, generator=g, dtype=F64, requires_grad=True)  # [V, H]
    ids = torch.randint(0, 9, (2, 6), generator=g)
    mix = torch.randn(4, 4, generator=g, dtype=F64)
    h = torch.tanh(emb[ids] @ mix)  # [N, T, H] a stand-in "model"
    logp, ent = chunked_token_logprobs(h, emb, ids.roll(-1, 1), chunk_tokens=5, with_entropy=True)
    ref_logp, ref_ent = _reference(h, emb, None, ids.roll(-1, 1), 1.0)
    (got,) = torch.autograd.grad(logp.sum() + 0.1 * ent.sum(), emb, retain_graph=True)
    (want,) = torch.autograd.grad(ref_logp.sum() + 0.1 * ref_ent.sum(), emb)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_float32_close_to_float64():
    """float32 end to end: logits of size ~5 carry ~1e-6 relative rounding (eps 1.2e-7 times
    a 4-term dot product and the log-sum-exp), so 1e-5 absolute is a bound with margin."""
    h, w, b, y = _case(v=37, seed=6)
    h32, w32, b32 = (x.detach().float().requires_grad_(True) for x in (h, w, b))
    logp, ent = chunked_token_logprobs(h32, w32, y, b32, 0.9, 6, with_entropy=True)
    ref_logp, ref_ent = _reference(h, w, b, y, 0.9)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    got = torch.autograd.grad(logp.sum() + ent.sum(), (h32, w32, b32))
    want = torch.autograd.grad(ref_logp.sum() + ref_ent.sum(), (h, w, b))
    for a, e in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), e, atol=1e-5, rtol=0)


def test_bfloat16_inputs():
    """bf16 matmul (as a bf16 LM head), float32 softmax. The only large error is the bf16
    rounding of each logit, |dz| <= 2^-8 |z|; log p = z_y - lse moves by at most 2 max|dz|."""
    h, w, b, y = _case(v=37, seed=7)
    hb, wb, bb = (x.detach().bfloat16().requires_grad_(True) for x in (h, w, b))
    logp, ent = chunked_token_logprobs(hb, wb, y, bb, 1.0, 4, with_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32
    ref_logp, _ = _reference(hb.double(), wb.double(), bb.double(), y, 1.0)  # same inputs
    z_max = torch.nn.functional.linear(hb.double(), wb.double(), bb.double()).abs().max()
    assert (logp.double() - ref_logp).abs().max() <= 2 * 2 ** -8 * z_max * 1.01
    logp.sum().add(ent.sum()).backward()
    assert hb.grad.dtype == wb.grad.dtype == bb.grad.dtype == torch.bfloat16
    assert all(torch.isfinite(x.grad).all() for x in (hb, wb, bb))


def test_extreme_logits_stay_finite():
    h, w, b, y = _case(v=23, seed=8, scale=1e4)  # logits ~1e4: one-hot distributions
    logp, ent = chunked_token_logprobs(h, w, y, b, 1.0, 4, with_entropy=True)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert (logp <= 0).all() and (ent >= -1e-12).all()
    (logp.sum() + ent.sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in (h, w, b))


def test_empty_and_default_chunk():
    h, w, b, y = _case(n=0)
    logp, ent = chunked_token_logprobs(h, w, y, b, with_entropy=True)
    assert logp.shape == ent.shape == (0, 5)
    (logp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, 5, 4) and (w.grad == 0).all() and (b.grad == 0).all()
    assert default_chunk_tokens(151936) == 27 and default_chunk_tokens(10 ** 9) == 1


@pytest.mark.parametrize("kwargs,msg", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(chunk_tokens=0), "chunk_tokens must be >= 1"),
    (dict(keep_elements=-1), "keep_elements must be >= 0"),
    (dict(tokens=torch.full((3, 5), 11)), r"token ids must be in \[0, 11\)"),
    (dict(tokens=torch.zeros(3, 4, dtype=torch.long)), r"tokens must have shape \(3, 5\)"),
    (dict(bias=torch.zeros(10)), r"bias must have shape \(11,\)"),
    (dict(weight=torch.zeros(11, 3)), "must share H"),
])
def test_bad_arguments_one_clear_error(kwargs, msg):
    h, w, b, y = _case()
    args = dict(hidden=h, weight=w, tokens=y, bias=b) | kwargs
    with pytest.raises(ValueError, match=msg):
        chunked_token_logprobs(**args)


class _LiveBytes(TorchDispatchMode):
    """Tensor-allocation hook: an op output whose storage is none of the op's inputs' (not a
    view, not in-place, not out=) is a fresh allocation; it counts while its tensor lives
    (user-level views keep their base alive through ._base). `peak` is the most bytes such
    tensors held at once, `largest` the biggest one's numel."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = self.mm_calls = 0

    def _free(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.mm_calls += func.__name__.startswith(("mm", "addmm"))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in given:
                continue
            nbytes = t.untyped_storage().nbytes()
            given.add(t.untyped_storage().data_ptr())
            self.live += nbytes
            weakref.finalize(t, self._free, nbytes)
            self.largest = max(self.largest, t.numel())
        self.peak = max(self.peak, self.live)
        return out


def test_memory_no_full_logits_saved_or_created():
    n, t, hdim, v, chunk = 4, 16, 8, 512, 4  # M*V = 32768 >> V*H = 4096 >> C*V = 2048
    m = n * t
    h, w, b, y = _case(n, t, hdim, v, dtype=torch.float32, seed=9)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        logp, ent = chunked_token_logprobs(h, w, y, b, 1.0, chunk, with_entropy=True,
                                           keep_elements=0)
    # saved: the inputs themselves (no copies) and [M] vectors (tokens, lse, entropy)
    inputs = {x.data_ptr() for x in (h, w, b)}
    assert all(x.data_ptr() in inputs or x.numel() <= m for x in saved), [x.shape for x in saved]
    with _LiveBytes() as fwd:
        logp, ent = chunked_token_logprobs(h, w, y, b, 1.0, chunk, with_entropy=True,
                                           keep_elements=0)
    with _LiveBytes() as bwd:
        (logp.sum() + ent.sum()).backward()
    assert bwd.mm_calls >= 3 * (m // chunk)  # the hook saw the backward: 3 matmuls a chunk
    assert max(fwd.largest, bwd.largest) <= v * hdim  # grad_W; the logits are only C*V
    # Bound, float32 bytes: the gradients (grad_h M*H, grad_W V*H, grad_b V), two reused
    # [C, V] chunk buffers, and [M]/[C] vectors (outputs, lse, slices: 16*M floats at
    # most). A fresh [C, V] or [V, H] per chunk would break it (measured 38,920 <= 40,960).
    bound = 4 * (m * hdim + v * hdim + v + 2 * chunk * v + 16 * m)
    assert max(fwd.peak, bwd.peak) <= bound < 4 * m * v
    with torch.no_grad(), _LiveBytes() as nograd:   # the default keep: nothing kept without a graph
        chunked_token_logprobs(h, w, y, b, 1.0, chunk, with_entropy=True)
    assert nograd.largest <= chunk * v and nograd.peak <= bound
    with _LiveBytes() as kept:                       # ... and the whole [M, V] with one
        chunked_token_logprobs(h, w, y, b, 1.0, chunk, with_entropy=True)
    assert kept.largest == m * v
    with _LiveBytes() as full:  # the control: the unchunked path does create [M, V]
        ref_logp, ref_ent = _reference(h, w, b, y, 1.0)
        (ref_logp.sum() + ref_ent.sum()).backward()
    assert full.largest >= m * v and full.peak >= 4 * m * v > bound


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_logits_give_the_recomputed_gradients_with_fewer_head_matmuls(with_entropy, temperature):
    """keep_elements = 2 chunks of logits (rounded down to whole chunks): those two chunks'
    logits stay from forward to backward, so the backward runs the head matmul for the other
    chunks only, and every value and gradient is the recomputing path's, bitwise (the same
    products of the same inputs, then the same operations)."""
    n, t, hdim, v, chunk = 3, 5, 4, 11, 4              # M = 15 rows: chunks of 4, 4, 4, 3
    m, keep = n * t, 2 * chunk * v + v - 1             # 2 whole chunks (+ less than a row)
    runs = {}
    for k in (0, keep, m * v):                          # none, two chunks, every chunk
        h, w, b, y = _case(n, t, hdim, v, seed=10)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
            logp, ent = chunked_token_logprobs(h, w, y, b, temperature, chunk,
                                               with_entropy=with_entropy, keep_elements=k)
        out = logp.sum() + (ent.sum() if with_entropy else 0)
        with _LiveBytes() as bwd:
            out.backward()
        kept = max((x.shape[0] for x in saved if x.dim() == 2 and x.shape[1] == v
                    and x.data_ptr() != w.data_ptr()), default=0)
        runs[k] = (logp, ent, h.grad, w.grad, b.grad, bwd.mm_calls, kept)
    chunks = -(-m // chunk)                            # 4
    # backward matmuls: grad_h and grad_W per chunk, plus the head again per recomputed chunk
    assert [runs[k][5] for k in (0, keep, m * v)] == [3 * chunks, 3 * chunks - 2, 2 * chunks]
    assert [runs[k][6] for k in (0, keep, m * v)] == [0, 2 * chunk, m]     # rows of kept logits
    for k in (keep, m * v):
        for a, e in zip(runs[k][:5], runs[0][:5]):
            assert (a is None and e is None) or torch.equal(a, e)
    ref_logp, _ = _reference(*_case(n, t, hdim, v, seed=10), temperature)
    torch.testing.assert_close(runs[keep][0], ref_logp, atol=1e-12, rtol=0)
