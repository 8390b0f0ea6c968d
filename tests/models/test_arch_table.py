"""The architecture table: every architecture of tests/models/arch_zoo.py (tiny, random
init, local BPE tokenizer) through rlctl's rollout, training, eval, and the learner's
log-probs against the model's own logits. The results make docs/architectures.md; the
doc test fails when that file is out of date, and

    RLCTL_WRITE_ARCH_TABLE=1 .venv/bin/python -m pytest -q tests/models/test_arch_table.py

rewrites it from the results. Each cell is run once per session and shared by its own
test and the doc test.

A cell passes ("yes"), is refused ("refused: ..."; rlctl's one-line bad-input error,
exit 2, naming the architecture), or fails ("fails: ..." with the error's first line).
Cells that fail on main today are expected failures (strict: once a fix lands they
pass, and the mark must go).
"""
import json
import math
import os
from pathlib import Path
from typing import Callable, Dict, NamedTuple

import pytest
import torch

from arch_zoo import ARCHS, ATTENTION_LAYERS, HYBRIDS, build_arch
from rlctl.errors import user_message

DOC = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
COLUMNS = ("rollout", "train", "eval", "logprobs")
COMMON = ["task.prompt_format=chat", "task.num_digits=3", "task.num_eval=4",
          "trainer.prompts_per_step=2", "algo.group_size=2", "rollout.max_new_tokens=8",
          "trainer.eval_every=0"]
# (architecture, column) -> why it fails on main: an expected failure until fixed (none now;
# at 825a51d the hybrids' rollout, train and eval failed on their caches, and Falcon-H1's
# and RecurrentGemma's log-probs on the fused head)
PENDING: Dict[tuple, str] = {}
# Architectures whose transformers code runs a stage in float32 whatever the model's dtype,
# and the stage: their float64 log-probs carry that stage's rounding (see _tolerance).
FLOAT32_STAGES = {
    "gemma2": "eager attention, softmax(..., dtype=float32); in float64 the padding mask's "
              "finfo(float64).min becomes -inf there, so a pad query's row is NaN: checked in float32",
    "qwen3_next": "the gated DeltaNet kernel casts q, k, v, beta and the decay to float32",
    "qwen3_5": "the gated DeltaNet kernel casts q, k, v, beta and the decay to float32",
}
DTYPES = {"gemma2": torch.float32}                # the rest: float64


class Cell(NamedTuple):
    status: str          # "yes" | "refused" | "fails"
    text: str            # the reason for "refused" / "fails"


# ---- the four columns: each returns on success and raises otherwise --------------------
def _rollout(name: str, model_dir: Path, tmp: Path) -> None:
    """``rlctl rollout`` in-process: rlctl's sampler with prompt sharing on (the default),
    2 prompts x 2 samples, then the learner's log-probs of each row."""
    from rlctl.commands.rollout_cmd import run_rollout

    summary = run_rollout(str(model_dir), COMMON, out=str(tmp / "roll.jsonl"), prompts=2,
                          samples=2, quiet=True)
    rows = [json.loads(line) for line in (tmp / "roll.jsonl").read_text().splitlines()]
    assert summary["rows"] == len(rows) == 4, summary
    for r in rows:
        assert 1 <= r["length"] == len(r["token_ids"]) == len(r["logprobs"]) <= 8, r
        assert all(math.isfinite(v) and v <= 0 for v in r["logprobs"]), r["logprobs"]


def _train(name: str, model_dir: Path, tmp: Path) -> None:
    """``rlctl train model=hf`` in-process, 2 steps of PPO (a value head on the model's
    backbone, 2 epochs, so pi_old and the update's forwards both run) with a KL to the
    reference (its forward too) and an entropy bonus (a random model earns no reward, so
    the bonus is what gives the update a gradient), prompt sharing on."""
    from rlctl.train.run import run_training
    from rlctl.sinks.jsonl import read_jsonl

    run = run_training(["model=hf", f"model.name_or_path={model_dir}", "algo=ppo",
                        "algo.kl.coef=0.05", "algo.entropy_coef=0.01", "trainer.steps=2", "logger=jsonl",
                        "logger.console=false", f"run.output_dir={tmp / 'runs'}", *COMMON])
    rows = [r for r in read_jsonl(Path(run["run_dir"]) / "metrics.jsonl") if "policy/loss" in r]
    assert [r["step"] for r in rows] == [1, 2], f"steps logged: {[r['step'] for r in rows]}"
    for r in rows:
        for key in ("policy/loss", "value/loss", "optim/grad_norm", "kl/seq_k1"):
            assert math.isfinite(r[key]), f"{key} = {r[key]}"
        assert r["optim/grad_norm"] > 0, f"optim/grad_norm = {r['optim/grad_norm']}"
    assert (Path(run["run_dir"]) / "model" / "config.json").is_file()


def _eval(name: str, model_dir: Path, tmp: Path) -> None:
    """``rlctl eval`` in-process: greedy (``generate`` over a shared prompt prefill) and
    2 samples per prompt (rlctl's sampler), 4 prompts."""
    from rlctl.commands.eval_cmd import run_eval

    result = run_eval(str(model_dir), COMMON, samples=2, out=str(tmp / "eval.json"), quiet=True)
    assert result["num_prompts"] == 4, result
    for split in ("greedy", "sampled"):
        assert 1 <= result[split]["length_mean"] <= 8, result[split]
        assert 0 <= result[split]["truncated_frac"] <= 1, result[split]


def _logprob_batch(tok):
    """Two chat prompts of different lengths x 2 rows (left-padded, the rollout's layout)
    and random completions of 6, 3, 6 and 1 tokens, pad after the end."""
    from rlctl.tasks.task import render_chat
    from rlctl.tasks.sorting import SortingTask

    short, long_ = (render_chat(tok, SortingTask(num_digits=n, num_eval=4).train_examples()[0].prompt)
                    for n in (3, 8))
    enc = tok([long_, long_, short, short], return_tensors="pt", padding=True)
    T = 6
    comp = torch.randint(0, len(tok), (4, T), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(T)[None] < torch.tensor([6, 3, 6, 1])[:, None]).long()    # [4, T]
    comp = torch.where(mask.bool(), comp, torch.full_like(comp, tok.pad_token_id))
    assert enc["attention_mask"][2, 0] == 0                   # the short prompt is padded
    return (torch.cat([enc["input_ids"], comp], 1), torch.cat([enc["attention_mask"], mask], 1),
            enc["input_ids"].shape[1], mask)                  # [4, P+T], [4, P+T], P, [4, T]


def _own_logprobs(model, ids, attn, P: int) -> torch.Tensor:
    """The reference: each row alone, its pads dropped (positions 0..L-1, no mask, so no
    padding convention of rlctl or the model enters), log_softmax of ``out.logits`` at
    the positions that predict its completion tokens -> [N, T] (0 past a row's end)."""
    T = ids.shape[1] - P
    ref = torch.zeros(ids.shape[0], T, dtype=torch.float64)
    for i in range(ids.shape[0]):
        row = ids[i][attn[i].bool()][None]                              # [1, L]
        p = int(attn[i, :P].sum())
        logits = model(input_ids=row[:, :-1]).logits[0, p - 1:].double()   # [t, V]
        lp = torch.log_softmax(logits, -1).gather(-1, row[0, p:, None])[:, 0]
        ref[i, :len(lp)] = lp
    return ref


def _tolerance(name: str) -> float:
    """Float64 throughout: each logit is a few hundred products summed per layer, ~1e-16
    relative rounding each, so two orders of summation (chunked head vs full logits, a
    shared prompt cache vs the whole row) agree to ~1e-14 (measured <= 2e-15); 1e-10 is far
    below what a wrong position, mask, cache row or logit transform gives (>= 1e-4 on these
    models). With a float32 stage (FLOAT32_STAGES) the stage's outputs are rounded to
    2**-24 = 6e-8 relative, and how they round depends on the row's offset in the batch
    (left padding moves a row within the kernel's chunks), so log-probs of |logp| <= ~7
    differ by a few float32 ulps of that size, ~1e-6 (measured 3e-8 for the DeltaNet
    models, 5e-7 for Gemma 2 in float32): 1e-5 there."""
    return 1e-5 if name in FLOAT32_STAGES else 1e-10


def _logprobs(name: str, model_dir: Path, tmp: Path) -> None:
    """``learner_forward`` as the trainer runs it (fused head, prompt groups found on the
    CPU) and its other paths (full logits, sharing found on the device, no sharing) vs
    the model's own logits, in float64 (DTYPES: where not)."""
    from rlctl.models.forward import PromptGroups, learner_forward
    from rlctl.models.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("hf", name_or_path=str(model_dir))
    model = model.to(DTYPES.get(name, torch.float64)).eval()
    if "grouped_mm" in str(getattr(model.config, "_experts_implementation", None)):
        model.set_experts_implementation("eager")    # torch's grouped_mm has no float64
    ids, attn, P, mask = _logprob_batch(tok)
    with torch.no_grad():
        ref = _own_logprobs(model, ids, attn, P)                                   # [4, T]
        groups = PromptGroups.of(ids, attn, P)
        off = {}
        for fused in (True, False):
            for share in (groups, True, False):
                lp = learner_forward(model, ids, attn, P, share_prompts=share, fused=fused).logp
                err = float(((lp.double() - ref) * mask).abs().max())
                if not err <= _tolerance(name):
                    label = f"{'fused' if fused else 'full-logits'}{'' if share is False else ' shared'}"
                    off[label] = f"{err:.0e}"
    assert not off, "learner log-probs off the model's own by " + ", ".join(
        f"{v} ({k})" for k, v in off.items())


RUNNERS: Dict[str, Callable] = dict(rollout=_rollout, train=_train, eval=_eval,
                                    logprobs=_logprobs)


# ---- cells, run once per session ---------------------------------------------------------
def _classify(exc: BaseException, name: str, arch_class: str) -> Cell:
    line, code = user_message(exc)
    if code == 2 and (arch_class in line or name in line):
        return Cell("refused", line)
    if code == 2:
        return Cell("fails", f"refused without naming {arch_class}: {line}")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    kind = "" if isinstance(exc, AssertionError) else f"{type(exc).__name__}: "
    return Cell("fails", (kind + text)[:200])


@pytest.fixture(scope="session")
def cell(tmp_path_factory) -> Callable[[str, str], Cell]:
    """``cell(arch, column)`` -> its Cell, computed once per session (models built once)."""
    root, dirs, cells = tmp_path_factory.mktemp("arch_zoo"), {}, {}

    def get(name: str, column: str) -> Cell:
        if name not in dirs:
            dirs[name] = build_arch(name, root / name)
        if (name, column) not in cells:
            tmp = root / f"{name}-{column}"
            tmp.mkdir()
            arch_class = json.loads((dirs[name] / "config.json").read_text())["architectures"][0]
            torch.manual_seed(0)
            try:
                RUNNERS[column](name, dirs[name], tmp)
                cells[name, column] = Cell("yes", "")
            except Exception as exc:              # noqa: BLE001 - the table records it
                cells[name, column] = _classify(exc, name, arch_class)
        return cells[name, column]
    return get


def _params():
    for name in ARCHS:
        for column in COLUMNS:
            why = PENDING.get((name, column))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            yield pytest.param(name, column, marks=marks, id=f"{name}-{column}")


@pytest.mark.parametrize("name,column", list(_params()))
def test_cell(cell, name, column):
    got = cell(name, column)
    assert got.status in ("yes", "refused"), f"{name} {column}: {got.text}"


def test_each_hybrid_has_attention_and_recurrent_layers():
    """The hybrids' own layer patterns at the zoo's depth hold an attention layer (as
    released checkpoints do) and a linear-attention / state-space layer."""
    import transformers

    for name in HYBRIDS:
        _, cls, fields = ARCHS[name]
        conf = getattr(transformers, cls)(vocab_size=400, **fields)
        attention = ATTENTION_LAYERS[name](conf)
        assert attention, name
        assert name == "falcon_h1" or len(attention) < conf.num_hidden_layers, name


# ---- the doc ---------------------------------------------------------------------------
def _kind(name: str) -> str:
    return "hybrid" if name in HYBRIDS else "MoE" if "moe" in name else "dense"


def _markdown(cells: Dict[tuple, Cell]) -> str:
    def show(c: Cell) -> str:
        return "yes" if c.status == "yes" else f"{c.status}: {c.text}".replace("|", "\\|")
    rows = [f"| {name} | {_kind(name)} | `{ARCHS[name][1].removesuffix('Config')}` | "
            + " | ".join(show(cells[name, c]) for c in COLUMNS) + " |" for name in ARCHS]
    full = [n for n in ARCHS if all(cells[n, c].status == "yes" for c in COLUMNS)]
    return "\n".join([
        "# Architectures",
        "",
        "Which transformers architectures rlctl runs, measured by",
        "`tests/models/test_arch_table.py` on tiny random-init models of each",
        "(`tests/models/arch_zoo.py`: a local BPE tokenizer with the family's chat template",
        "and stop ids, sliding windows shorter than a prompt, hybrids with an attention layer",
        "in their own layer pattern). Columns: `rlctl rollout` (rlctl's sampler, prompt",
        "sharing on), `rlctl train` (2 PPO steps: value head, KL to the reference, entropy",
        "bonus), `rlctl eval` (greedy and sampled), and log-probs: the learner's forward",
        "(fused head and full logits, with and without prompt sharing) equals a plain",
        "transformers forward",
        "of each row alone (no padding) to 1e-10 in float64, or to 1e-5 where transformers",
        "runs a stage in float32 (listed below). This file is generated: rerun the test",
        "with `RLCTL_WRITE_ARCH_TABLE=1` to update it.",
        "",
        "| architecture | kind | config | rollout | train | eval | log-probs |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"All four: {len(full)} of {len(ARCHS)} "
        f"({sum(n in HYBRIDS for n in full)} of {len(HYBRIDS)} hybrids).",
        "",
        "Float32 stages (log-probs to 1e-5):",
        "",
        *[f"- {n}: {why}." for n, why in FLOAT32_STAGES.items()],
        "",
    ])


def test_docs_table_is_current(cell):
    text = _markdown({(n, c): cell(n, c) for n in ARCHS for c in COLUMNS})
    if os.environ.get("RLCTL_WRITE_ARCH_TABLE") == "1":
        DOC.write_text(text)
    assert DOC.is_file() and DOC.read_text() == text, (
        "docs/architectures.md is out of date; regenerate it with RLCTL_WRITE_ARCH_TABLE=1 "
        ".venv/bin/python -m pytest -q tests/models/test_arch_table.py")


def test_at_least_15_architectures_and_3_hybrids_pass_every_column(cell):
    full = [n for n in ARCHS if all(cell(n, c).status == "yes" for c in COLUMNS)]
    assert len(full) >= 15 and sum(n in HYBRIDS for n in full) >= 3, full
