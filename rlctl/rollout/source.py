"""Where a step's rollouts come from: ``Source``, ``SyncSource``, ``collect`` (DAPO's dynamic sampling)."""
from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from rlctl.config.schema import AlgoConfig, RolloutConfig
from rlctl.core import zero_std_groups
from rlctl.errors import ConfigError
from rlctl.models.stop_ids import resolve_stop_ids
from rlctl.rollout.generate import rollout
from rlctl.types import LogProbs
from rlctl.tasks.scoring import RewardScorer
from rlctl.types import Example, RolloutBatch

SEED_RANGE = 2 ** 31     # the environments' seeds of an episodic task


class Source(Protocol):
    """What the trainer asks of a rollout source."""
    prompt_rng: random.Random      # draws the rows; its state is checkpointed
    scorer: RewardScorer           # the training rewards and their counters
    player: Optional[Any]          # an episodic task's EpisodePlayer (eval, sample tables), else None

    def sample(self, num_groups: int) -> RolloutBatch:
        """``num_groups`` prompts x G completions (or episodes)."""

    def after_update(self) -> None:
        """The learner's weights moved on (one optimizer step per rollout)."""

    def metrics(self) -> Dict[str, float]:
        """The source's own metrics since the last call (async/*, time/*, engine/*)."""

    def close(self) -> None:
        """Stops what the source started (engines, reward workers)."""


class SyncSource(Source):
    """Rows drawn with replacement by ``prompt_rng``; no metrics; the scorer closed at the end."""
    examples: List[Example]
    player = None

    def draw(self, num_groups: int) -> List[int]:
        return [self.prompt_rng.randrange(len(self.examples)) for _ in range(num_groups)]

    def after_update(self) -> None:
        pass

    def metrics(self) -> Dict[str, float]:
        return {}

    def close(self) -> None:
        self.scorer.close()


class LocalSource(SyncSource):
    """The synchronous loop: B prompts x ``algo.group_size`` completions sampled from ``policy``."""

    def __init__(self, policy, tokenizer, examples: Sequence[Example], scorer,
                 rollout: RolloutConfig, algo: AlgoConfig, share_prompts: bool, seed: int,
                 generate_kwargs: Optional[Dict] = None):
        self.policy, self.tokenizer, self.examples = policy, tokenizer, list(examples)
        self.scorer, self.rollout, self.share_prompts = scorer, rollout, share_prompts
        self.group_size = algo.group_size
        self.engine_logprobs = bool(algo.rollout_correction.enabled)
        self.prompt_rng = random.Random(seed)
        self.generate_kwargs = dict(generate_kwargs or {})
        self.stops = resolve_stop_ids(policy, tokenizer, tuple(rollout.stop_token_ids or ()))

    def sample(self, num_groups: int) -> RolloutBatch:
        ro = self.rollout
        examples = [self.examples[i] for i in self.draw(num_groups)]
        batch = rollout(self.policy, self.tokenizer, examples, self.group_size, ro.max_new_tokens,
                        ro.temperature, ro.top_k, self.scorer.score_batch,
                        share_prompts=self.share_prompts, stops=self.stops,
                        engine_logprobs=self.engine_logprobs, sample_dtype=ro.sample_dtype,
                        **self.generate_kwargs)
        return batch.replace(reward_parts=self.scorer.last_components)   # this batch's, per row


class PairSource(SyncSource):
    """Preference pairs (examples with fields chosen and rejected): B pairs drawn with
    replacement as B groups of 2 rows, the chosen answer first (reward 1) then the rejected
    (reward 0), each answer's tokens then the first stop id; an answer that does not fit
    in ``max_new_tokens`` with its stop id is refused (ConfigError), never cut."""
    group_size = 2

    def __init__(self, tokenizer, examples: Sequence[Example], eval_examples: Sequence[Example],
                 scorer, stops: Sequence[int], max_new_tokens: int, seed: int, device):
        self.tokenizer, self.examples, self.eval_examples = tokenizer, list(examples), list(eval_examples)
        self.scorer, self.stop = scorer, int(stops[0])
        self.prompt_rng, self.device = random.Random(seed), device
        self.ref_rows: Optional[Dict[str, List[torch.Tensor]]] = None   # per split, per row
        texts = [ex.fields[k] for ex in self.examples + self.eval_examples for k in ("chosen", "rejected")]
        long = sum(len(ids) + 1 > max_new_tokens
                   for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else 0
        if long:
            raise ConfigError(f"{long} of {len(texts)} answers exceed rollout.max_new_tokens="
                              f"{max_new_tokens} (with the stop id); raise it")

    def sample(self, num_groups: int) -> RolloutBatch:
        return self.batch("train", self.draw(num_groups))

    def batch(self, split: str, index: Sequence[int]) -> RolloutBatch:
        """The pairs ``index`` of ``split`` (train | eval), with cached reference log-probs."""
        examples = [(self.examples if split == "train" else self.eval_examples)[i] for i in index]
        texts = [ex.fields[k] for ex in examples for k in ("chosen", "rejected")]   # N = 2B
        enc = self.tokenizer([ex.prompt for ex in examples for _ in "cr"], return_tensors="pt",
                             padding=True)
        answers = [ids + [self.stop] for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        T = max(map(len, answers))
        ids = torch.full((len(answers), T), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(answers), T)                                       # [N, T]
        for i, a in enumerate(answers):
            ids[i, :len(a)], mask[i, :len(a)] = torch.tensor(a, dtype=torch.long), 1.0
        ref = None
        if self.ref_rows is not None:
            rows = [self.ref_rows[split][2 * i + k] for i in index for k in (0, 1)]
            ref = torch.stack([torch.nn.functional.pad(r, (0, T - len(r))) for r in rows])   # [N, T]
        d = self.device
        return RolloutBatch(
            input_ids=torch.cat([enc["input_ids"], ids], 1).to(d),
            attention_mask=torch.cat([enc["attention_mask"], mask.long()], 1).to(d),
            mask=mask.to(d), truncated=torch.zeros(len(answers), dtype=torch.bool, device=d),
            rewards=torch.tensor([1.0, 0.0] * len(examples), device=d),
            group_ids=torch.arange(len(examples), device=d).repeat_interleave(2),
            prompt_len=enc["input_ids"].shape[1], group_size=2,
            prompts=[ex.prompt for ex in examples for _ in "cr"], completions=texts,
            logprobs=LogProbs(ref=None if ref is None else ref.to(d)))

    def cache_reference(self, ref_logp: Callable[[RolloutBatch], torch.Tensor], chunk: int) -> None:
        """Every pair's reference log-probs (``ref_logp``: batch -> [N, T]; ``chunk`` pairs a
        forward) computed once and kept on the CPU, each row cut to its answer; later
        batches carry them."""
        rows: Dict[str, List[torch.Tensor]] = {}
        for split, examples in (("train", self.examples), ("eval", self.eval_examples)):
            rows[split] = []
            for start in range(0, len(examples), chunk):
                b = self.batch(split, range(start, min(start + chunk, len(examples))))
                logp = ref_logp(b).float().cpu()                                   # [n, T]
                rows[split] += [r[:int(m.sum())] for r, m in zip(logp, b.mask.cpu())]
        self.ref_rows = rows


def keep_informative_groups(batch: RolloutBatch) -> RolloutBatch:
    """Rows of the groups whose rewards are not all equal."""
    keep = ~zero_std_groups(batch.rewards.view(-1, batch.group_size))        # [B]
    rows = keep.repeat_interleave(batch.group_size).nonzero().squeeze(-1)  # [N_kept]
    # renumber groups 0..kept-1 so rows of group g stay at g*G .. g*G+G-1
    return batch.select(rows).replace(group_ids=_group_ids(int(keep.sum()), batch.group_size, rows.device))


def _group_ids(num_groups: int, G: int, device) -> torch.Tensor:
    return torch.arange(num_groups, device=device).repeat_interleave(G)        # [B*G]


def collect(sample: Callable[[int], RolloutBatch], num_groups: int, dynamic: bool,
            max_rounds: int, pad_id: int) -> Tuple[RolloutBatch, float]:
    """One step's batch and the fraction of sampled groups kept (1.0 without filtering)."""
    if not dynamic:
        return sample(num_groups), 1.0
    kept: List[RolloutBatch] = []
    have, sampled = 0, 0
    for _ in range(max_rounds):
        batch = sample(num_groups)
        sampled += num_groups
        good = keep_informative_groups(batch)
        n_good = good.num_sequences // batch.group_size
        if n_good:
            take = min(n_good, num_groups - have)
            kept.append(good.select(torch.arange(take * batch.group_size, device=good.mask.device)))
            have += take
        if have >= num_groups:
            break
    if not kept:              # every group constant: train on the last batch (zero advantages)
        return batch, 0.0
    # one batch kept: no re-padding copy; several: stale and fresh old log-probs kept as a pair
    out = kept[0] if len(kept) == 1 else RolloutBatch.concat(kept, pad_id)
    return out.replace(group_ids=_group_ids(have, out.group_size, out.mask.device)), have / sampled
