"""Preference optimisation (algo=dpo, task=preferences) through the real learner.

The accumulation test runs the tiny Llama in float64 (its RMSNorm too) on sorting pairs of
ragged lengths with a fixed synthetic reference: the gradient of one batch is the
gradient of the mean over pairs of DPO's loss, computed here from a plain transformers
forward. Every micro-batch split (rows, a token budget) must give the same gradient up to
float64 rounding: sums of ~100 terms of size < 10 differ by < 1e-13, so 1e-12 leaves a
margin, where a split pair fails and a mean per micro-batch is off by 10-50 %. The runs
are 2-step `rlctl train` calls on pairs made from sorting."""
import copy
import json
import math
import re
import shutil
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_two_ranks
import torch.nn.functional as F

from learner_kit import settings
from rlctl.config.compose import compose
from rlctl.core import PREFERENCE_LOSSES
from rlctl.dist.backends import TorchBackend, build_backend
from rlctl.models.loading import load_model_and_tokenizer
from rlctl.rollout.source import PairSource
from rlctl.tasks.sorting import SortingTask
from rlctl.train.update import UpdateState, accumulate_gradients
from rlctl.types import LogProbs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dist"))
from dp_worker import _rms_norm_in_input_dtype  # noqa: E402

BETA = 0.5


def _model_and_pairs():
    """The float64 tiny Llama and 6 sorting pairs of ragged lengths with a synthetic reference."""
    from transformers.models.llama import modeling_llama
    modeling_llama.LlamaRMSNorm.forward = _rms_norm_in_input_dtype
    opts = {k: v for k, v in dict(compose([]).cfg.model).items() if k != "name"}
    model, tok = load_model_and_tokenizer("tiny", **opts)
    task = SortingTask()
    examples = task.preference_pairs(task.train_examples(), 6, seed=3)
    b = PairSource(tok, examples, [], None, [tok.eos_token_id], 8, 0, "cpu").batch("train", range(6))
    g = torch.Generator().manual_seed(5)
    ref = (-2.0 + torch.randn(b.mask.shape, generator=g, dtype=torch.float64)) * b.mask
    return model.double(), b.replace(mask=b.mask.double(), logprobs=LogProbs(ref=ref))


@pytest.fixture(scope="module")
def pairs_setup():
    from transformers.models.llama import modeling_llama
    norm = modeling_llama.LlamaRMSNorm.forward
    try:
        yield _model_and_pairs()
    finally:
        modeling_llama.LlamaRMSNorm.forward = norm


def _grads(model, b, backend=None, **kw):
    """The gradient of ``b``'s share of the loss (over every rank's pairs) and the metrics."""
    model = copy.deepcopy(model)
    s = settings(share_prompts=False, **kw,
                 preference=partial(PREFERENCE_LOSSES.get("sigmoid"), beta=BETA,
                                    label_smoothing=0.0, gamma=0.0))
    m = accumulate_gradients(model, backend or TorchBackend("cpu"), b, s, UpdateState())
    return [p.grad.clone() for p in model.parameters()], m


def _hand_loss(model, b):
    """DPO's mean loss from a plain forward: -log sigmoid(beta (ratio_c - ratio_r))."""
    P = b.prompt_len
    logits = model(input_ids=b.input_ids[:, :-1], attention_mask=b.attention_mask[:, :-1]).logits
    logp = torch.log_softmax(logits[:, P - 1:].double(), -1).gather(-1, b.input_ids[:, P:, None])[..., 0]
    ratio = ((logp - b.logprobs.ref) * b.mask).sum(-1)                       # [2P]
    return -F.logsigmoid(BETA * (ratio[0::2] - ratio[1::2])).mean()


SPLITS = {"rows=2": dict(micro_batch_size=2), "rows=3": dict(micro_batch_size=3),
          "tokens": dict(micro_batch_tokens=40), "rows=1": dict(micro_batch_size=1)}


def test_pair_loss_is_exact_over_micro_batches_and_equals_dpo(pairs_setup):
    model, b = pairs_setup
    assert b.mask.sum(-1).unique().numel() > 1                               # ragged answers
    whole, m = _grads(model, b)
    ref_model = copy.deepcopy(model)
    loss = _hand_loss(ref_model, b)
    loss.backward()
    loss = loss.detach()
    hand = [p.grad for p in ref_model.parameters()]
    assert float(m["policy/loss"]) == pytest.approx(float(loss), rel=1e-12, abs=0)
    for g, h in zip(whole, hand):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)
    for name, kw in SPLITS.items():
        split, ms = _grads(model, b, **kw)
        assert float(ms["policy/loss"]) == pytest.approx(float(loss), rel=1e-12, abs=0), name
        for g, h in zip(split, whole):
            torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12, msg=name)


RUN = ["algo=dpo", "task=preferences", "task.pairs_from=sorting", "task.num_pairs=64",
       "task.num_eval=16", "trainer.steps=2", "trainer.eval_every=2", "trainer.prompts_per_step=4",
       "trainer.checkpoint_every=1", "logger=jsonl", "logger.console=false",
       "logger.samples.every=1", "run.save_model=false"]


def _metrics(run: Path):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
            for r in rows if "step" in r}


@pytest.fixture(scope="module")
def dpo_run(rlctl_app, tmp_path_factory):
    run = tmp_path_factory.mktemp("dpo") / "run"
    done = rlctl_app("train", *RUN, f"run.dir={run}")
    assert done.returncode == 0, done.stdout + done.stderr
    return run


@pytest.mark.parametrize("extra", [[], ["model.lora.enabled=true", "model.lora.lr=1e-3"],
                                   ["algo.precompute_ref_logps=true"]],
                         ids=["full", "lora", "precomputed-reference"])
def test_a_dpo_run_logs_the_pair_metrics_and_starts_at_the_reference(rlctl_app, dpo_run, tmp_path,
                                                                     extra):
    run = dpo_run
    if extra:
        run = tmp_path / "run"
        done = rlctl_app("train", *RUN, "trainer.checkpoint_every=0", *extra, f"run.dir={run}")
        assert done.returncode == 0, done.stdout + done.stderr
    m = _metrics(run)
    first, last = m[1], m[2]
    # step 1: the policy is the reference (frozen copy, adapter off, or cached): rewards 0
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[k] == pytest.approx(0.0, abs=1e-6), k
    assert first["policy/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    assert abs(last["rewards/chosen"]) > 1e-4 and 0 <= last["rewards/accuracy"] <= 1   # it moved
    for k in ("eval/pairwise_accuracy", "eval/margin", "eval/exact_match"):   # held out
        assert k in last
    # labels, not rewards: chosen 1 / rejected 0 would log reward/mean 0.5 on every step
    assert not {"reward/mean", "reward/std", "reward/frac_zero_std_groups", "advantage/mean",
                "advantage/std"} & set(first)
    assert "length/mean" in first
    if not extra:                    # inspect reads the pairs' figures in their place
        report = tmp_path / "report.json"
        done = rlctl_app("inspect", str(run), "--json", str(report))
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(report.read_text())["metrics"]["rewards/accuracy"]["n"] == len(m) - 1
        assert (run / "inspect_pairs.png").read_bytes()[:4] == b"\x89PNG"
    samples = (run / "samples.jsonl").read_text()
    assert '"split": "eval"' in samples or "eval" in samples


def test_dpo_resume_redoes_the_last_step_exactly(rlctl_app, dpo_run, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(dpo_run, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000002")
    (cut / "summary.json").unlink()
    done = rlctl_app("train", "--resume", str(cut))
    assert done.returncode == 0, done.stdout + done.stderr
    assert _metrics(cut) == _metrics(dpo_run)


def test_a_bad_pairs_file_gets_the_reward_model_s_error_line(rlctl_app, tmp_path):
    bad = tmp_path / "prefs.jsonl"
    bad.write_text(json.dumps({"prompt": "1 2 =", "chosen": "1 2"}) + "\n"
                   + json.dumps({"prompt": "2 1 =", "chosen": "1 2", "rejected": 3}) + "\n")
    rm = rlctl_app("reward-model", "train", str(bad), "model=tiny")
    dpo = rlctl_app("train", "algo=dpo", "task=preferences", f"task.train_path={bad}")
    assert rm.returncode != 0 and dpo.returncode == rm.returncode
    line = rm.stderr.strip().splitlines()[-1]
    assert "has no 'rejected' column" in line
    # the reader's words, its key renamed, after the task's name as every task error has it
    assert dpo.stderr.strip().splitlines()[-1] == line.replace(
        "error: PREFS", "error: task 'preferences': task.train_path")


def _rank_worker(out_dir: str) -> None:
    """One of 2 ranks (a subprocess of the test below): pairs 3r..3r+2, micro-batches of 2 rows;
    the gradients summed over ranks as the backend's step averages them (x world / world)."""
    backend = build_backend("torch", "cpu")
    model, b = _model_and_pairs()
    rank = backend.rank
    grads, m = _grads(model, b.select(torch.arange(6 * rank, 6 * rank + 6)), backend,
                      micro_batch_size=2)
    summed = [backend.all_reduce(g) / backend.world_size for g in grads]
    loss = backend.all_reduce(m["policy/loss"].detach())
    if rank == 0:
        torch.save({"grads": summed, "loss": loss}, Path(out_dir) / "two.pt")
    backend.close()


def test_two_ranks_give_the_one_batch_gradient(pairs_setup, tmp_path):
    model, b = pairs_setup
    whole, m = _grads(model, b)
    run_two_ranks("test_dpo", f"_rank_worker({str(tmp_path)!r})", tmp_path, 300,
                  paths=[Path(__file__).resolve().parent.parent / "dist"])
    two = torch.load(tmp_path / "two.pt")
    assert float(two["loss"]) == pytest.approx(float(m["policy/loss"]), rel=1e-12, abs=0)
    for g, h in zip(two["grads"], whole):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)


def test_held_out_pairs_go_in_micro_batch_chunks(rlctl_app, tmp_path, monkeypatch):
    """65 held-out pairs, trainer.micro_batch_size=2 rows: the cached reference and the
    held-out pair metrics take one pair a forward, and every pair once."""
    sizes = {"train": [], "eval": []}
    batch = PairSource.batch

    def spy(self, split, index):
        sizes[split].append(len(index))
        return batch(self, split, index)
    monkeypatch.setattr(PairSource, "batch", spy)
    run = tmp_path / "run"
    done = rlctl_app("train", *RUN, "task.num_eval=65", "trainer.steps=1", "trainer.eval_every=1",
                     "trainer.checkpoint_every=0", "logger.samples.every=0",
                     "trainer.micro_batch_size=2", "algo.precompute_ref_logps=true", f"run.dir={run}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(sizes["eval"]) == {1} and len(sizes["eval"]) % 65 == 0   # cached, then each eval
    assert len(sizes["eval"]) >= 130
    assert set(sizes["train"][:-1]) == {1} and len(sizes["train"]) == 64 + 1   # the step: 4
    assert 0 <= _metrics(run)[1]["eval/pairwise_accuracy"] <= 1


def test_a_preference_loss_must_return_per_pair_tensors(rlctl_app, tmp_path):
    (tmp_path / "summed_loss.py").write_text(
        "def loss(c, r, rc, rr, nc, nr, *, beta, label_smoothing, gamma):\n"
        "    return -(beta * (c - rc - r + rr)).sigmoid().log().sum(), c - rc, r - rr\n")
    done = rlctl_app("train", *RUN, "algo.loss_type=summed_loss:loss", f"run.dir={tmp_path / 'run'}",
                     path=[tmp_path])
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: algo.loss_type=summed_loss:loss must return (loss, reward_chosen, reward_rejected), "
        "each [P] for P pairs; on 2 pairs it returned [], [2], [2]")


def test_answers_longer_than_the_budget_are_refused(rlctl_app, tmp_path):
    done = rlctl_app("train", *RUN, "rollout.max_new_tokens=6", f"run.dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert re.fullmatch(r"error: \d+ of 160 answers exceed rollout.max_new_tokens=6 \(with the "
                        r"stop id\); raise it", done.stderr.strip().splitlines()[-1])
