"""Peak RSS and time of the learner's log-prob forward+backward: chunked vs unchunked.

    .venv/bin/python bench/logprob_memory.py                  # V=151936, H=256, N*T=8*8*128
    .venv/bin/python bench/logprob_memory.py --tokens 2048 --vocab 32768

Each variant runs in its own subprocess (one torch thread, float32), so the peak RSS
(`ru_maxrss`) it prints is its own; "inputs" is the RSS once h [M, H], W [V, H] and the
targets exist, so peak - inputs is what the log-prob computation itself costs.
- unchunked: what the learner does without the fused path: logits = h @ W^T ([M, V]),
  `token_logprobs` with gradient, `entropy_from_logits` of the detached logits (a metric).
- chunked: `chunked_token_logprobs(..., with_entropy=True)`, backward from the log-probs.
- chunked+entropy-grad: the same with an upstream gradient on the entropy too (an
  entropy bonus), which costs no extra memory.
The unchunked variant needs about 4 x M x V x 4 bytes (measured 3.6x; 20 GB at the defaults); it is
skipped with a line saying so when the machine has less available (--force runs it).

Measured on a shared 2-core, 24 GB CPU machine (load average 2-4 from other jobs, so
times are noisy; all variants agree on sum logp and mean entropy):
    N*T=8192: unchunked 18.93 GB peak (18.41 above inputs), 116 s fwd + 69 s bwd;
              chunked 0.57 GB (0.05 above inputs), 49 s + 74 s; with entropy gradient
              0.57 GB, 23 s + 55 s.
    N*T=2048 (quieter): unchunked 5.01 GB, 6.7 s + 6.9 s; chunked 0.55 GB, 5.6 s + 14.2 s.
The chunked backward recomputes the logits (one more LM-head matmul and exp), so on a
quiet machine it is about 1.5x the unchunked time; it saves 4.5 GB per 2048 tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from common import markdown

VARIANTS = ("unchunked", "chunked", "chunked+entropy-grad")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _available_gb() -> float:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) / 2 ** 20


def _worker(args) -> dict:
    import torch
    from rlctl.core import chunked_token_logprobs, entropy_from_logits, token_logprobs
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_(True)  # [M, H]
    w = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5).requires_grad_(True)
    y = torch.randint(0, args.vocab, (args.tokens,), generator=g)  # [M]
    g_logp, g_ent = torch.randn(2, args.tokens, generator=g)  # upstream gradients
    inputs_mb = _rss_mb()
    t0 = time.perf_counter()
    if args.worker == "unchunked":
        logits = torch.nn.functional.linear(h, w) / args.temperature  # [M, V]
        logp = token_logprobs(logits[None], y[None])[0]  # [M]
        ent = entropy_from_logits(logits.detach()[None])[0]  # [M]
        loss = (logp * g_logp).sum()
    else:
        logp, ent = chunked_token_logprobs(h, w, y, temperature=args.temperature,
                                           chunk_tokens=args.chunk, with_entropy=True)
        loss = (logp * g_logp).sum()
        if args.worker == "chunked+entropy-grad":
            loss = loss + (ent * g_ent).sum()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    return dict(variant=args.worker, inputs_mb=inputs_mb, peak_mb=_rss_mb(), fwd_s=t1 - t0,
                bwd_s=t2 - t1, logp_sum=float(logp.detach().double().sum()),
                ent_mean=float(ent.double().mean()))


def _run(variant: str, args) -> dict | str:
    need_gb = 4 * args.tokens * args.vocab * 4 / 2 ** 30 + 1
    if variant == "unchunked" and not args.force and _available_gb() < need_gb:
        return f"skipped: needs ~{need_gb:.1f} GB, {_available_gb():.1f} GB available (--force)"
    cmd = [sys.executable, __file__, "--worker", variant] + [
        f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "tokens", "chunk", "temperature")]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return "failed: " + ((proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=8 * 8 * 128, help="N*T rows")
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: 4M / V)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--force", action="store_true", help="run unchunked even if memory looks short")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.chunk is None:
        from rlctl.core.logprobs import default_chunk_tokens
        args.chunk = default_chunk_tokens(args.vocab)
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    print(f"V={args.vocab} H={args.hidden} N*T={args.tokens} chunk={args.chunk} float32, 1 thread")
    rows = []
    for v in args.variants.split(","):
        r = _run(v, args)
        if isinstance(r, str):
            rows.append([v, r, "", "", "", "", ""])
            continue
        rows.append([v, f"{r['peak_mb'] / 1024:.2f}", f"{(r['peak_mb'] - r['inputs_mb']) / 1024:.2f}",
                     f"{r['fwd_s']:.1f}", f"{r['bwd_s']:.1f}", f"{r['logp_sum']:.6g}",
                     f"{r['ent_mean']:.6g}"])
    print(markdown(["variant", "peak RSS GB", "peak - inputs GB", "forward s", "backward s",
                    "sum logp", "mean entropy"], rows))


if __name__ == "__main__":
    main()
