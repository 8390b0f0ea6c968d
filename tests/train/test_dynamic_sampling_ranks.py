"""Dynamic sampling (DAPO) with several ranks: each rank keeps its own number of groups,
so the update and the metrics must not depend on a rank's row count.

- every rank takes exactly algo.minibatches optimizer steps per epoch whatever its row
  count (a different count per rank means mismatched collectives: a hang);
- algo.minibatches > algo.group_size is refused with dynamic sampling (a rank may keep
  one group: G rows, fewer than the minibatches, and would take an empty step);
- per-sequence means (kl/seq_k1: the adaptive KL's input) are weighted by each rank's
  sequence count, not averaged over ranks."""
import os

import pytest
import torch

from learner_kit import settings
from rlctl.config.compose import compose
from rlctl.core import get_policy_loss
from rlctl.errors import ConfigError
from rlctl.models.forward import learner_forward
from rlctl.train.metrics import reduce_metrics
from rlctl.train.update import UpdateState, update_policy
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.types import LogProbs, RolloutBatch

G = 4


class CountingBackend:
    """One process standing in for one rank: counts optimizer steps."""
    world_size, dp_loss_scale = 1, 1.0

    def __init__(self, model):
        self.opt, self.steps = torch.optim.SGD(model.parameters(), lr=1e-3), 0

    def zero_grad(self):
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()
        self.steps += 1
        return torch.ones(())

    def all_reduce(self, t, op="sum"):
        return t


def _batch(tok, groups: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    n, T = groups * G, 4
    enc = tok(["3 1 4 ="] * n, return_tensors="pt")
    comp = torch.tensor(tok.convert_tokens_to_ids([str(d) for d in range(10)]))[torch.randint(0, 10, (n, T),
                                                                                              generator=g)]
    mask = torch.ones(n, T)
    b = RolloutBatch(input_ids=torch.cat([enc["input_ids"], comp], 1),
                     attention_mask=torch.cat([enc["attention_mask"], mask.long()], 1), mask=mask,
                     truncated=torch.zeros(n, dtype=torch.bool), rewards=torch.rand(n, generator=g),
                     group_ids=torch.arange(n) // G, prompt_len=enc["input_ids"].shape[1], group_size=G,
                     prompts=["p"] * n, completions=["c"] * n)
    b.advantages = torch.randn(n, 1, generator=g) * mask
    return b


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_every_rank_takes_minibatches_steps(groups):
    """3 minibatches over 4, 8 or 12 rows (one rank keeping 1, 2 or 3 groups of 4):
    torch.chunk gave 2, 3 and 3 pieces; each must take 3 steps per epoch."""
    model, tok = load_model_and_tokenizer("tiny", cache_dir=os.environ.get("RLCTL_CACHE"),
                                          hidden_size=32, num_layers=1, num_heads=2)
    backend = CountingBackend(model)
    s = settings(policy_loss=get_policy_loss("ppo_clip"), clip_low=0.2, clip_high=0.2,
                       agg_mode="token-mean", norm_len=None, epochs=2, minibatches=3, kl_estimator="k3",
                       kl_in_loss=False, temperature=1.0, share_prompts=False)
    batch = _batch(tok, groups)
    with torch.no_grad():
        batch.logprobs = LogProbs(old=learner_forward(model, batch.input_ids, batch.attention_mask,
                                                      batch.prompt_len, 1.0).logp)
    update_policy(model, backend, batch, s, UpdateState())
    assert backend.steps == 2 * 3


def test_more_minibatches_than_a_group_is_one_line():
    with pytest.raises(ConfigError, match=r"^algo.minibatches=5 with algo.dynamic_sampling=true must be "
                                          r"<= algo.group_size=4"):
        compose(["algo=dapo", "algo.group_size=4", "trainer.prompts_per_step=4", "algo.minibatches=5"])
    compose(["algo=dapo", "algo.group_size=4", "trainer.prompts_per_step=3", "algo.minibatches=4"])


class Recorder:
    """Rank 1 of two: sends its tensors (kept, in call order) and gets its own back."""
    world_size = 2

    def __init__(self):
        self.sent = []

    def all_reduce(self, t, op="sum"):
        self.sent.append(t.clone())
        return t


class Replayer:
    """Rank 0 of two: each collective combines its tensor with rank 1's tensor of the same
    call (both ranks run the same code on the same keys, so the calls line up)."""
    world_size = 2

    def __init__(self, sent):
        self.sent = iter(sent)

    def all_reduce(self, t, op="sum"):
        o = next(self.sent)
        return {"sum": t + o, "min": torch.minimum(t, o), "max": torch.maximum(t, o)}[op]


def test_seq_k1_is_weighted_by_sequences():
    """Rank 0: 4 sequences with mean KL 1.0; rank 1: 12 with 3.0. Over the 16 sequences
    (4 * 1 + 12 * 3) / 16 = 2.5 (a plain average over ranks: 2.0)."""
    mine = {"kl/seq_k1": 1.0, "perf/step_sequences": 4.0, "policy/entropy": 0.5, "length/max": 3.0}
    theirs = {"kl/seq_k1": 3.0, "perf/step_sequences": 12.0, "policy/entropy": 1.5, "length/max": 7.0}
    rank1 = Recorder()
    reduce_metrics({k: torch.tensor(v) for k, v in theirs.items()}, rank1)
    out = reduce_metrics({k: torch.tensor(v) for k, v in mine.items()}, Replayer(rank1.sent))
    assert out["kl/seq_k1"] == pytest.approx(2.5)
    assert out["perf/step_sequences"] == 16.0 and out["length/max"] == 7.0
    assert out["policy/entropy"] == pytest.approx(1.0)          # not per sequence: plain average
