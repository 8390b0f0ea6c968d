"""Real architectures in miniature (tests/models/real_arch.py: Llama-3, Qwen2, GPT-2, Gemma
with byte-level BPE tokenizers, chat templates and their stop ids): LoRA with the default
targets, train, resume, eval and rollout with chat prompts, and left padding under GPT-2's
absolute position embeddings.

Stop ids (generation_config.eos_token_id lists, a stop id equal to the pad id): rlctl's
eval and rollout stop where Hugging Face ``generate`` stops."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlctl.config.schema import LoraConfig

pytest.importorskip("peft")

from real_arch import FAMILIES  # noqa: E402

from rlctl.models.loading import load_model_and_tokenizer  # noqa: E402
from rlctl.models.lora import apply_lora  # noqa: E402
from rlctl.sinks.jsonl import read_jsonl  # noqa: E402

RLCTL = shutil.which("rlctl") or str(Path(sys.executable).parent / "rlctl")
HF_YAML = Path(__file__).resolve().parents[2] / "rlctl" / "config" / "conf" / "model" / "hf.yaml"
COMMON = ["task.prompt_format=chat", "task.num_digits=3", "task.num_eval=8",
          "trainer.prompts_per_step=2", "algo.group_size=2", "rollout.max_new_tokens=8",
          "trainer.eval_every=0"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline",
                TOKENIZERS_PARALLELISM="false")


def _cli(*args, cwd):
    out = subprocess.run([RLCTL, *args], capture_output=True, text=True, timeout=600,
                         env=_env(), cwd=cwd)
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _rows(path):
    """The rows of a rollout dump (one JSON object per line)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _stop_ids(model_dir):
    """Every stop id the checkpoint declares: tokenizer EOS + generation_config's list."""
    gen = json.loads((Path(model_dir) / "generation_config.json").read_text())["eos_token_id"]
    _, tok = load_model_and_tokenizer("hf", name_or_path=str(model_dir))
    return {tok.eos_token_id, *(gen if isinstance(gen, list) else [gen])}


@pytest.fixture(scope="module")
def lora_runs(real_arch, tmp_path_factory, rlctl_app):
    """family -> run directory of ``rlctl train model=hf ... model.lora.enabled=true`` with
    the default target modules (2 steps, checkpoint at step 2), run once per module by the
    CLI app in-process (test_cli_eval_rollout_resume_on_a_lora_run runs the console script)."""
    runs = {}

    def get(family):
        if family not in runs:
            out_dir = tmp_path_factory.mktemp(f"lora-{family}")
            out = rlctl_app("train", "model=hf", f"model.name_or_path={real_arch(family)}",
                            "model.lora.enabled=true", "trainer.steps=2", "trainer.checkpoint_every=2",
                            "logger=jsonl", f"run.output_dir={out_dir}", *COMMON, cwd=out_dir)
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
            runs[family] = next(p for p in out_dir.iterdir() if (p / "recipe.yaml").is_file())
        return runs[family]
    return get


# ---- LoRA: the default targets are every linear layer but the head ---------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_default_lora_targets_every_linear_but_the_head(real_arch, family):
    model, _ = load_model_and_tokenizer("hf", name_or_path=str(real_arch(family)))
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, Conv1D)                       # GPT-2 uses Conv1D
    linears = {n for n, m in model.named_modules() if n and isinstance(m, kinds)}
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    # the group file's value where it sets one, else the schema's default
    default = (OmegaConf.load(HF_YAML).get("lora") or {}).get("target_modules") \
        or LoraConfig().target_modules
    peft_model = apply_lora(model, r=2, alpha=4, dropout=0.0, target_modules=list(default))
    adapted = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules()
               if hasattr(m, "lora_A") and not n.endswith(("lora_A", "lora_B"))}
    assert adapted == linears - {head} and head == "lm_head"
    leaves = {n.rsplit(".", 1)[-1] for n in adapted}
    if family == "gpt2":                                    # transformers' Conv1D layers
        assert leaves == {"c_attn", "c_proj", "c_fc"}
    else:
        assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"}


# ---- train (LoRA, chat prompts) through the CLI ----------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_train_lora_with_chat_prompts(lora_runs, family):
    run = lora_runs(family)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["lora"] is True and 0 < summary["params_trainable"] < summary["params_total"]
    assert (run / "model" / "adapter_model.safetensors").is_file()
    assert (run / "checkpoints" / "step-00000002").is_dir()
    targets = json.loads((run / "model" / "adapter_config.json").read_text())["target_modules"]
    leaves = {t.rsplit(".", 1)[-1] for t in targets}         # peft saves the resolved names
    assert ("c_attn" in leaves) == (family == "gpt2") and "lm_head" not in leaves


# ---- full fine-tune, then --resume (in-process: exact against an uninterrupted run) -----
@pytest.mark.parametrize("family", FAMILIES)
def test_full_finetune_resume_matches_an_uninterrupted_run(real_arch, family, tmp_path):
    from rlctl.train.run import run_training

    base = ["model=hf", f"model.name_or_path={real_arch(family)}", "logger=jsonl",
            "logger.console=false", "trainer.checkpoint_every=1", "trainer.lr=1e-3", *COMMON]
    one = run_training(base + [f"run.output_dir={tmp_path / 'a'}", "trainer.steps=2"])
    run_a = Path(one["run_dir"])
    run_training(["trainer.steps=3"], resume=str(run_a))
    run_b = Path(run_training(base + [f"run.output_dir={tmp_path / 'b'}",
                                      "trainer.steps=3"])["run_dir"])
    a, b = (read_jsonl(r / "metrics.jsonl") for r in (run_a, run_b))
    keys = ("reward/mean", "policy/loss", "optim/grad_norm", "length/mean")
    assert [r["step"] for r in a if "reward/mean" in r] == [1, 2, 3]
    assert [[r.get(k) for k in keys] for r in a if "reward/mean" in r] == \
        [[r.get(k) for k in keys] for r in b if "reward/mean" in r]
    trained, tok = load_model_and_tokenizer("hf", name_or_path=str(run_a / "model"))
    start, _ = load_model_and_tokenizer("hf", name_or_path=str(real_arch(family)))
    moved = [n for n, p in trained.state_dict().items()
             if not torch.equal(p, start.state_dict()[n])]
    assert moved                                           # trained and saved
    tied = trained.get_output_embeddings().weight is trained.get_input_embeddings().weight
    assert tied == (family in ("qwen2", "gemma", "gpt2"))  # tying survives save and reload


# ---- eval and rollout (in-process) on the LoRA runs ------------------------------------
def _chat_affixes(tok):
    """(prefix, suffix) the chat template puts around a user prompt, BOS dropped."""
    from rlctl.tasks.task import render_chat

    before, after = render_chat(tok, "@@").split("@@")
    return before, after


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_renders_chat_prompts_and_ends_at_stop_ids(lora_runs, real_arch, family,
                                                            tmp_path):
    from rlctl.commands.rollout_cmd import run_rollout

    run = lora_runs(family)
    summary = run_rollout(str(run), [], out=str(tmp_path / "roll.jsonl"), prompts=3,
                          samples=2, quiet=True)
    rows = _rows(tmp_path / "roll.jsonl")
    assert summary["rows"] == len(rows) == 6
    _, tok = load_model_and_tokenizer("hf", name_or_path=str(real_arch(family)))
    before, after = _chat_affixes(tok)
    assert all(r["prompt"].startswith(before) and r["prompt"].endswith(after) for r in rows)
    stops = _stop_ids(real_arch(family))
    for r in rows:
        ids = r["token_ids"]
        first = next((i for i, t in enumerate(ids) if t in stops), None)
        assert first is None or (r["length"] == first + 1 and r["ended_with_eos"]
                                 and not r["truncated"]), f"{family} row {ids} goes past a stop id"
        assert (first is None) == r["truncated"] and set(r["stop_token_ids"]) == stops
        assert not any(t in stops for t in ids[:-1])          # nothing counted after the end


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_stops_where_hf_generate_stops(real_arch, family, tmp_path):
    """Greedy eval of the (warmed-up) base model: rlctl's truncated fraction and lengths
    equal those of Hugging Face ``generate`` with the checkpoint's generation config, one
    prompt at a time (no padding)."""
    from rlctl.commands.eval_cmd import run_eval
    from rlctl.tasks.task import render_chat
    from rlctl.tasks import build_task

    model_dir = real_arch(family)
    result = run_eval(str(model_dir), COMMON, out=str(tmp_path / "eval.json"), quiet=True)
    greedy = result["greedy"]
    assert result["num_prompts"] == 8 and 0.0 <= greedy["exact_match"] <= 1.0
    model, tok = load_model_and_tokenizer("hf", name_or_path=str(model_dir))
    stops, lengths, truncated = _stop_ids(model_dir), [], []
    for ex in build_task("sorting", num_digits=3, num_eval=8, prompt_format="chat").eval_examples():
        ids = tok(render_chat(tok, ex.prompt), return_tensors="pt")
        new = model.generate(**ids, max_new_tokens=8, do_sample=False)[0, ids.input_ids.shape[1]:]
        first = next((i for i, t in enumerate(new.tolist()) if t in stops), None)
        lengths.append(len(new) if first is None else first + 1)
        truncated.append(first is None)
    hf = dict(truncated_frac=sum(truncated) / 8, length_mean=sum(lengths) / 8)
    assert hf["truncated_frac"] < 0.5         # the warm-up taught the family's end of turn
    got = dict(truncated_frac=greedy["truncated_frac"], length_mean=greedy["length_mean"])
    assert got == pytest.approx(hf, abs=1e-9), f"{family} rlctl greedy {got} vs generate {hf}"


# ---- the CLI's eval, rollout and --resume on one LoRA run ------------------------------
@pytest.mark.slow   # 40-100 s on 2 cores: eval, rollout and a resume through the console script
def test_cli_eval_rollout_resume_on_a_lora_run(lora_runs, tmp_path):
    run = lora_runs("qwen2")
    out = _cli("eval", str(run), "--out", str(tmp_path / "e.json"), cwd=tmp_path)
    assert json.loads((tmp_path / "e.json").read_text())["num_prompts"] == 8, out.stdout
    _cli("rollout", str(run), "--out", str(tmp_path / "r.jsonl"), "--prompts", "2",
         "--samples", "2", cwd=tmp_path)
    assert len(_rows(tmp_path / "r.jsonl")) == 4
    _cli("train", "--resume", str(run), "trainer.steps=3", cwd=tmp_path)
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (run / "checkpoints" / "step-00000003").is_dir()


# ---- left padding with absolute positions (GPT-2), float64 -----------------------------
def test_left_padding_with_absolute_positions_matches_the_prompt_alone(real_arch):
    """A short prompt left-padded next to a longer one scores its completion exactly as
    alone: rlctl's position ids skip the padding (float64, so any position shift shows
    far above rounding: 1e-10 vs the > 1e-3 a shifted position table gives)."""
    from rlctl.models.forward import learner_forward
    from rlctl.rollout.generate import generate

    model, tok = load_model_and_tokenizer("hf", name_or_path=str(real_arch("gpt2")))
    model = model.double().eval()
    prompts = ["User: 3 1 =\nAssistant:", "User: 9 8 7 6 5 4 3 2 1 =\nAssistant:"]
    seqs, p_mask, P = generate(model, tok, prompts, 6, do_sample=False, share_prompts=False)
    alone, a_mask, P1 = generate(model, tok, prompts[:1], 6, do_sample=False,
                                 share_prompts=False)
    assert p_mask[0].sum() < P and P1 == int(p_mask[0].sum())        # row 0 is left-padded
    assert torch.equal(seqs[0, P:], alone[0, P1:])                   # same greedy tokens
    full = torch.cat([p_mask, torch.ones_like(seqs[:, P:])], 1)       # [2, P+T]
    full1 = torch.cat([a_mask, torch.ones_like(alone[:, P1:])], 1)    # [1, P1+T]
    with torch.no_grad():
        for share in (False, True):
            batch = learner_forward(model, seqs, full, P, share_prompts=share).logp  # [2, T]
            single = learner_forward(model, alone, full1, P1, share_prompts=share).logp
            torch.testing.assert_close(batch[0], single[0], rtol=0, atol=1e-10)
        for share in (False, True):                # the lean sampler, near-greedy (T = 1e-4)
            torch.manual_seed(0)
            s_b, _, _, lp_b = generate(model, tok, prompts, 6, do_sample=True, temperature=1e-4,
                                       return_logprobs=True, share_prompts=share)   # [2, T]
            s_1, _, _, lp_1 = generate(model, tok, prompts[:1], 6, do_sample=True,
                                       temperature=1e-4, return_logprobs=True, share_prompts=share)
            assert torch.equal(s_b[0, P:], seqs[0, P:]) and torch.equal(s_1[0, P1:], alone[0, P1:])
            # behaviour log-probs from float32 copies of float64 logits, divided by 1e-4:
            # one float32 ulp of a logit (< 8e-6 for |logit| < 64) becomes < 0.08 in the
            # scaled scores; the greedy token's log-prob is ~0 in both, so 0.1 is the bound
            torch.testing.assert_close(lp_b[0, :lp_1.shape[1]], lp_1[0], rtol=0, atol=0.1)
        naive = model(input_ids=seqs, attention_mask=full).logits     # positions 0..P+T-1
    shifted = torch.log_softmax(naive[0, P - 1:-1], -1).gather(-1, seqs[0, P:, None])[:, 0]
    assert (shifted - single[0]).abs().max() > 1e-3                  # the test can fail
