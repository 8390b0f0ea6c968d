"""One rank of the data-parallel equivalence check (run by test_data_parallel.py).

    python dp_worker.py OUT_DIR CASES_JSON

Every rank builds the same tiny model and the same synthetic rollout of N sequences
(whole groups), keeps its contiguous share of the groups, and runs a few update steps
through the backend for each case; rank 0 saves the initial and final parameters per
case (``<name>-init.pt``, ``<name>.pt``).

A case is a dict: name, backend, zero_stage, agg, tiny (model sizes), and optionally
dtype ("float32" | "float64"), optim ("adamw" | "sgd"), steps, lr, max_grad_norm;
uneven (rank r runs 1 + 4r forwards in ``backend.sampling`` first, as ranks generating
different lengths do; the grad norm is then checked equal on every rank), save (``backend.save_state`` into OUT_DIR/<name>-ckpt after the
steps) and load (a checkpoint directory ``backend.load_state`` reads before the steps).
``optim=sgd`` swaps the backend's AdamW for plain SGD (no momentum, no decay), so that
with lr=1 and no clipping the weights after one step are ``w0 - g``: the test reads the
gradient off the weights, whatever the backend does with them (ZeRO partitions).
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/

from learner_kit import settings  # noqa: E402

from rlctl.dist.backends import build_backend# noqa: E402
from rlctl.train.update import UpdateState, update_policy  # noqa: E402
from rlctl.models.loading import load_model_and_tokenizer  # noqa: E402
from rlctl.types import RolloutBatch  # noqa: E402

B, G, T, STEPS = 4, 3, 6, 3
PART_MB = 0.1        # the weights pushed to engines: buckets of 0.1 MiB (test_data_parallel)


def synthetic_batch(tok) -> RolloutBatch:
    g = torch.Generator().manual_seed(1234)
    n = B * G
    enc = tok(["3 1 4 1 5 ="] * n, return_tensors="pt")
    digits = torch.tensor(tok.convert_tokens_to_ids([str(d) for d in range(10)]))
    comp = digits[torch.randint(0, 10, (n, T), generator=g)]
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    b = RolloutBatch(input_ids=torch.cat([enc["input_ids"], comp], 1),
                     attention_mask=torch.cat([enc["attention_mask"], mask.long()], 1),
                     mask=mask, truncated=lengths == T, rewards=torch.rand(n, generator=g),
                     group_ids=torch.arange(n) // G, prompt_len=enc["input_ids"].shape[1],
                     group_size=G, prompts=["p"] * n, completions=["c"] * n)
    b.advantages = torch.randn(n, 1, generator=g) * mask
    return b


def _sgd(params, lr, betas=None, weight_decay=0.0, fused=None):
    return torch.optim.SGD(params, lr=lr)                  # the backend's AdamW call, as SGD


def _rms_norm_in_input_dtype(self, hidden_states):
    # transformers' LlamaRMSNorm computes in float32 whatever the model's dtype; for the
    # float64 check the same formula runs in float64, so no float32 rounding is left
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _state(backend, module) -> dict:
    with backend.gathered(module) as full:     # FSDP2: rank 0's gathered full state dict
        state = module.state_dict() if full is None else full
        return {k: v.detach().clone() for k, v in state.items()}


def run_case(case: dict, rank: int, world: int, out_dir: str) -> None:
    from transformers.models.llama import modeling_llama

    dtype = case.get("dtype", "float32")
    norm = modeling_llama.LlamaRMSNorm.forward
    if dtype == "float64":
        modeling_llama.LlamaRMSNorm.forward = _rms_norm_in_input_dtype
    try:
        _train_case(case, rank, world, out_dir, dtype)
    finally:
        modeling_llama.LlamaRMSNorm.forward = norm


def main(out_dir: str, cases: list) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    for case in cases:
        run_case(case, rank, world, out_dir)


def _train_case(case: dict, rank: int, world: int, out_dir: str, dtype: str) -> None:
    clip = case.get("max_grad_norm", 1.0)
    backend = build_backend(case["backend"], "cpu", case.get("zero_stage", 0))
    model, tok = load_model_and_tokenizer("tiny", cache_dir=os.environ.get("RLCTL_CACHE"),
                                          **case["tiny"])
    model = model.to(getattr(torch, dtype))      # (the loader offers no float64)
    if rank == 0:
        torch.save(_state(backend, model), os.path.join(out_dir, f"{case['name']}-init.pt"))
    full = synthetic_batch(tok)
    per = B // world
    rows = torch.arange(rank * per * G, (rank + 1) * per * G)
    batch = full.select(rows)
    s = settings(agg_mode=case["agg"],
                 # prompt sharing sums the group's prompt gradients in another
                 # order on 1 and 2 ranks (float32 rounding, 1e-7), which Adam's
                 # first steps amplify past 1e-5; it has its own exactness tests
                 share_prompts=False)
    adamw = torch.optim.AdamW      # (patched only now: deepspeed's import subclasses it)
    if case.get("optim", "adamw") == "sgd":
        torch.optim.AdamW = _sgd
    try:
        engine = backend.prepare(model, None, lr=case.get("lr", 1e-3), betas=(0.9, 0.999),
                                 weight_decay=0.0, warmup_steps=0, max_grad_norm=clip)
    finally:
        torch.optim.AdamW = adamw
    if case.get("load"):
        backend.load_state(Path(case["load"]))
    if case.get("uneven"):
        with backend.sampling(backend.unwrap()), torch.no_grad():
            for _ in range(1 + 4 * rank):
                engine(input_ids=batch.input_ids[:1, :4])
    for _ in range(case.get("steps", STEPS)):
        norm = update_policy(engine, backend, batch, s, UpdateState())["optim/grad_norm"]
        if case.get("uneven"):       # the clipping norm: a plain tensor, the same on every rank
            assert type(norm) is torch.Tensor and norm > 0, norm
            assert backend.all_reduce(norm, "min") == backend.all_reduce(norm, "max"), norm
    if case.get("save"):
        (Path(out_dir) / f"{case['name']}-ckpt").mkdir(exist_ok=True)
        backend.save_state(Path(out_dir) / f"{case['name']}-ckpt")
    state = _state(backend, backend.unwrap())
    parts = list(backend.weight_buckets(backend.unwrap(), bucket_mb=PART_MB))   # every rank gathers
    if rank == 0:
        torch.save(state, os.path.join(out_dir, f"{case['name']}.pt"))
        torch.save(parts, os.path.join(out_dir, f"{case['name']}-parts.pt"))
    backend.barrier()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
