"""Generation engines on one GPU: engine log-probs against the learner's, and tokens/s.

    python bench/gpu_engines.py                         # random-init Llama (~0.3B), bf16
    python bench/gpu_engines.py --model /path/to/hf_dir --prompts 16 --group 8 --new-tokens 256
    python bench/gpu_engines.py --no-vllm               # the torch engine only

For each engine it samples ``prompts x group`` completions (random prompt token ids,
temperature 1, no stop ids, one seed) and prints:
- tokens/s: completion tokens / wall time of the generate call (after one warm-up call);
- mean and max |engine log-prob - learner log-prob| per completion token, where the
  learner's log-prob is ``rlctl.models.forward.learner_forward`` on prompt + completion
  (the training forward) with the same weights, once in bf16 (what training uses) and
  once in float32 (how far bf16 sampling is from exact).

Engines: ``torch`` (rlctl's TorchEngine on CUDA, bf16) and, where vLLM is installed, a
``vllm serve`` of the same weights (saved to a temporary directory) reached through the
server engine with ``kind="vllm"`` (started with ``--logprobs-mode processed_logprobs``,
so its log-probs are taken after temperature, as the learner's). Nothing is downloaded:
without ``--model`` the model is a random-init Llama built here. Sized to finish in under
5 minutes on one GPU (vLLM's start-up is most of it; ``--budget-s`` skips vLLM when too
little time is left). Without CUDA it exits with one line.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown  # noqa: E402

T0 = time.monotonic()


def build_model(args):
    """(bf16 CUDA model, pad id, HF directory or None)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else \
            (model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0)
        return model.to("cuda").eval(), int(pad), args.model
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.to("cuda").eval(), 0, None


def prompts_for(args, vocab: int):
    import torch
    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, min(vocab, 30000), (args.prompts, args.prompt_len), generator=g)
    return [row for row in base.tolist() for _ in range(args.group)]      # groups of equal prompts


def learner_gaps(model, prompts, outs, pad: int):
    """(mean, max) |engine - learner| per completion token, learner in the model's dtype
    and in float32."""
    import copy
    import torch
    from rlctl.models.forward import learner_forward
    P = len(prompts[0])                                   # every prompt has the same length
    T = max(len(c.token_ids) for c in outs)
    ids = torch.full((len(outs), P + T), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    engine = torch.zeros(len(outs), T, dtype=torch.float64)
    for i, (p, c) in enumerate(zip(prompts, outs)):
        n = len(c.token_ids)
        ids[i, :P + n] = torch.tensor(p + c.token_ids)
        mask[i, :P + n] = 1
        engine[i, :n] = torch.tensor(c.logprobs, dtype=torch.float64)
    valid = mask[:, P:].bool()                                                     # [N, T]
    device = next(model.parameters()).device
    rows = []
    for name, m in (("bf16", model), ("fp32", copy.deepcopy(model).float())):
        with torch.no_grad():
            logp = torch.cat([learner_forward(m, ids[j:j + 64].to(device), mask[j:j + 64].to(device), P,
                                              temperature=1.0).logp.double().cpu()
                              for j in range(0, len(outs), 64)])                  # [N, T]
        gap = (logp - engine).abs()[valid]
        rows.append((name, float(gap.mean()), float(gap.max())))
        del m
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generate(engine, prompts, sampling):
    engine.generate(prompts[:8], sampling.__class__(4, 1.0, 0, ()), seed=7)        # warm-up
    _sync()
    t = time.perf_counter()
    outs = engine.generate(prompts, sampling, seed=0)
    _sync()
    wall = time.perf_counter() - t
    return outs, sum(len(c.token_ids) for c in outs) / wall, wall


def run_torch(model, pad, prompts, sampling):
    from rlctl.rollout.engines.protocol import TorchEngine
    return timed_generate(TorchEngine(model, pad), prompts, sampling)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_vllm(model, model_dir, prompts, sampling, args):
    """Serve ``model`` with vLLM, generate through ServerEngine(kind="vllm"); None and a
    reason when it cannot."""
    from rlctl.rollout.engines.server import ServerEngine
    tmp = tempfile.mkdtemp(prefix="rlctl-vllm-")
    if model_dir is None:
        model_dir = os.path.join(tmp, "model")
        model.save_pretrained(model_dir, safe_serialization=True)
    port = _free_port()
    log = open(os.path.join(tmp, "vllm.log"), "w")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16",
           "--skip-tokenizer-init", "--logprobs-mode", "processed_logprobs",
           "--gpu-memory-utilization", str(args.vllm_memory), "--max-model-len",
           str(args.prompt_len + args.new_tokens + 8), "--seed", "0"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.vllm_start_s
        while True:
            if proc.poll() is not None:
                return None, f"vllm exited ({proc.returncode}): " + _tail(log.name)
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    return None, f"vllm not up after {args.vllm_start_s} s: " + _tail(log.name)
                time.sleep(2)
        print(f"vllm up after {time.monotonic() - T0:.0f} s since start", flush=True)
        engine = ServerEngine([url], kind="vllm", chunk_size=len(prompts), timeout_s=120)
        return timed_generate(engine, prompts, sampling), None
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _tail(path: str) -> str:
    lines = [l for l in Path(path).read_text(errors="replace").splitlines() if l.strip()]
    return lines[-1] if lines else "no output"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local Hugging Face model directory (default: random-init Llama)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-memory", type=float, default=0.4, help="vLLM --gpu-memory-utilization")
    ap.add_argument("--vllm-start-s", type=float, default=180.0)
    ap.add_argument("--budget-s", type=float, default=290.0, help="skip vLLM past this much time")
    args = ap.parse_args()

    import torch
    if not torch.cuda.is_available():
        sys.exit("gpu_engines: no CUDA device here (torch.cuda.is_available() is False); "
                 "run it where a GPU is lent")
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    from rlctl.rollout.engines.protocol import Sampling

    model, pad, model_dir = build_model(args)
    vocab = model.get_input_embeddings().num_embeddings
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"gpu: {torch.cuda.get_device_name(0)}; model: {args.model or 'random-init Llama'} "
          f"({n_params:.0f}M params, bf16); {args.prompts} prompts x {args.group}, prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens, temperature 1", flush=True)
    prompts = prompts_for(args, vocab)
    sampling = Sampling(args.new_tokens, 1.0, 0, ())

    table, notes = [], []
    outs, tps, wall = run_torch(model, pad, prompts, sampling)
    gaps = learner_gaps(model, prompts, outs, pad)
    table.append(["torch", f"{tps:,.0f}", f"{wall:.2f}"] + [f"{m:.2e} / {x:.2e}" for _, m, x in gaps])
    print(f"torch engine done at {time.monotonic() - T0:.0f} s", flush=True)

    if args.no_vllm:
        notes.append("vllm: skipped (--no-vllm)")
    elif importlib.util.find_spec("vllm") is None:
        notes.append("vllm: not installed here, skipped")
    elif time.monotonic() - T0 > args.budget_s - args.vllm_start_s:
        notes.append(f"vllm: skipped, {time.monotonic() - T0:.0f} s used of a {args.budget_s:.0f} s budget")
    else:
        got, why = run_vllm(model, model_dir, prompts, sampling, args)
        if got is None:
            notes.append(f"vllm: failed: {why}")
        else:
            outs, tps, wall = got
            gaps = learner_gaps(model, prompts, outs, pad)
            table.append(["vllm", f"{tps:,.0f}", f"{wall:.2f}"] + [f"{m:.2e} / {x:.2e}" for _, m, x in gaps])

    print()
    print(markdown(["engine", "tokens/s", "generate s", "|engine - learner bf16| mean / max",
                    "|engine - learner fp32| mean / max"], table))
    for n in notes:
        print(n)
    print(f"total {time.monotonic() - T0:.0f} s")


if __name__ == "__main__":
    main()
