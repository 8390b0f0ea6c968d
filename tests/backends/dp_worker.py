"""One rank of the data-parallel equivalence check (run by test_data_parallel.py).

    python dp_worker.py OUT_DIR CASES_JSON

Every rank builds the same tiny model and the same synthetic rollout of N sequences
(whole groups), keeps its contiguous share of the groups, and runs a few update steps
through the backend for each case; rank 0 saves the final parameters per case.
"""
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

torch.set_num_threads(1)

from rlctl.backends.base import build_backend  # noqa: E402
from rlctl.core import get_policy_loss  # noqa: E402
from rlctl.engine.update import UpdateSettings, UpdateState, update_policy  # noqa: E402
from rlctl.models.loading import load_model_and_tokenizer  # noqa: E402
from rlctl.types import RolloutBatch  # noqa: E402

B, G, T, STEPS = 4, 3, 6, 3


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


def main(out_dir: str, cases: list) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    for case in cases:
        backend = build_backend(case["backend"], "cpu", case.get("zero_stage", 0))
        model, tok = load_model_and_tokenizer("tiny", cache_dir=os.environ.get("RLCTL_CACHE"),
                                              **case["tiny"])
        full = synthetic_batch(tok)
        per = B // world
        rows = torch.arange(rank * per * G, (rank + 1) * per * G)
        batch = full.select(rows)
        s = UpdateSettings(policy_loss=get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.2,
                           agg_mode=case["agg"], norm_len=None, epochs=1, minibatches=1,
                           kl_estimator="k3", kl_in_loss=False, max_grad_norm=1.0, temperature=1.0,
                           # prompt sharing sums the group's prompt gradients in another
                           # order on 1 and 2 ranks (float32 rounding, 1e-7), which Adam's
                           # first steps amplify past 1e-5; it has its own exactness tests
                           share_prompts=False)
        engine = backend.prepare(model, None, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0,
                                 warmup_steps=0, max_grad_norm=1.0)
        for _ in range(STEPS):
            update_policy(engine, backend, batch, s, UpdateState())
        module = backend.unwrap()
        with backend.gathered(module):
            if rank == 0:
                state = {k: v.detach().clone() for k, v in module.state_dict().items()}
                torch.save(state, os.path.join(out_dir, f"{case['name']}.pt"))
        backend.barrier()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
