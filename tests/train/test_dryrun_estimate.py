"""`rlctl train --dry-run` (issue 21.13): the reward model is listed and counted, and the
memory estimate follows the knobs docs/memory.md lists beside it
(model.gradient_checkpointing, trainer.micro_batch_tokens, bf16). Expected values are
worked by hand from the rules in docs/memory.md and the config."""
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

MIB = 2 ** 20


def dry_run(*overrides):
    from rlctl.cli import app

    res = CliRunner().invoke(app, ["train", "--dry-run", *overrides], catch_exceptions=False)
    assert res.exit_code == 0, res.stdout + res.stderr
    return res.stdout


def row(out: str, name: str) -> float:
    (m,) = re.findall(rf"│ {re.escape(name)}\s*│\s*([\d.]+) │", out)
    return float(m)


@pytest.fixture(scope="module")
def cfg():
    from rlctl.config.compose import compose

    return compose([]).cfg


def test_the_reward_model_is_listed_and_counted(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from rlctl.rm.tiny_rm import tiny_reward_model_dir

    out = dry_run("--recipe", "rlhf-sorting", f"run.output_dir={tmp_path}")
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir())
    params = sum(p.numel() for p in rm.parameters())
    size = next(rm.parameters()).element_size()
    assert re.search(rf"reward model 'reward_model' \(frozen\)\s*│\s*{params:,} │\s*0 │", out), out
    assert row(out, "reward model(s)") == round(params * size / MIB, 1)
    assert "reward-model forward" in " ".join(out.split())
    parts = [row(out, k) for k in ("weights", "gradients", "optimizer state", "reference model",
                                   "reward model(s)", "activations (rough)",
                                   "generation KV cache", "logits")]
    assert row(out, "total") == pytest.approx(sum(parts), abs=0.05 * len(parts))  # each rounded to 0.1
    assert not any(tmp_path.iterdir())


def longest_prompt(tok, *overrides) -> int:
    """The tokens of the longest of the config task's first 256 training prompts, rendered by
    the tokenizer's chat template under task.prompt_format=chat, as the sampler reads them."""
    from rlctl.config.compose import compose
    from rlctl.train.build import task_from_config

    task_cfg = compose(list(overrides)).cfg.task
    system = task_cfg.get("system_prompt")
    lengths = []
    for ex in task_from_config(compose(list(overrides)).cfg).task.train_examples()[:256]:
        if task_cfg.prompt_format == "chat":
            msgs = [{"role": "system", "content": system}] if system else []
            lengths.append(len(tok.apply_chat_template(msgs + [{"role": "user", "content": ex.prompt}],
                                                       tokenize=True, add_generation_prompt=True,
                                                       return_dict=False)))
        else:
            lengths.append(len(tok(ex.prompt)["input_ids"]))
    return max(lengths)


def test_the_estimate_follows_checkpointing_token_budget_and_bf16(cfg, tmp_path):
    from rlctl.demo.tiny import build_tokenizer

    out_dir = f"run.output_dir={tmp_path}"
    h, layers = cfg.model.hidden_size, cfg.model.num_layers
    prompt = longest_prompt(build_tokenizer())
    seq = prompt + cfg.rollout.max_new_tokens             # the estimate's prompt + completion
    rows = cfg.trainer.prompts_per_step * cfg.algo.group_size // cfg.algo.minibatches
    base = dry_run(out_dir)
    assert f"prompts of {prompt} tokens," in " ".join(base.split())
    # 16 values per hidden unit, layer and token, fp32
    assert row(base, "activations (rough)") == round(16 * h * layers * rows * seq * 4 / MIB, 1)
    ckpt = dry_run("model.gradient_checkpointing=true", out_dir)
    # each layer keeps its input (1 value per hidden unit) + one layer's 16 while recomputed
    assert row(ckpt, "activations (rough)") == round(h * (layers + 16) * rows * seq * 4 / MIB, 1)
    budget = 10 * seq + seq // 2                          # room for 10 full rows, not 11
    packed = dry_run(f"trainer.micro_batch_tokens={budget}", out_dir)
    assert row(packed, "activations (rough)") == round(16 * h * layers * 10 * seq * 4 / MIB, 1)
    alone = dry_run(f"trainer.micro_batch_tokens={seq - 1}", out_dir)   # a row alone
    assert row(alone, "activations (rough)") == round(16 * h * layers * 1 * seq * 4 / MIB, 1)
    bf16 = dry_run("hardware.precision=bf16", out_dir)   # autocast: bf16 activations,
    assert row(bf16, "activations (rough)") == round(16 * h * layers * rows * seq * 2 / MIB, 1)
    for k in ("weights", "gradients", "optimizer state"):  # fp32 weights, grads, AdamW
        assert row(bf16, k) == row(base, k)
    half = dry_run("model.dtype=bfloat16", out_dir)      # 16-bit weights: every part halves
    for k in ("weights", "gradients", "optimizer state", "activations (rough)"):
        assert row(half, k) == pytest.approx(row(base, k) / 2, abs=0.1), k
    assert not any(tmp_path.iterdir())


def test_deepspeed_bf16_keeps_fp32_moments_and_a_master_copy(tmp_path):
    out = dry_run("hardware=deepspeed", "hardware.precision=bf16", f"run.output_dir={tmp_path}")
    (total, trainable) = map(lambda x: int(x.replace(",", "")),
                             re.findall(r"│ policy\s*│\s*([\d,]+) │\s*([\d,]+) │", out)[0])
    assert row(out, "weights") == round(total * 2 / MIB, 1)             # bf16 weights
    assert row(out, "optimizer state") == round(trainable * 12 / MIB, 1)  # 2 fp32 moments + master


def test_the_estimate_reads_the_chat_rendered_prompts(cfg, tmp_path):
    """A chat template and a long system prompt lengthen every prompt the sampler reads: the
    dry run assumes the longest rendered training prompt, so the activation term grows."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tasks"))
    from test_chat import chat_tokenizer

    from rlctl.demo.tiny import build_model

    tok = chat_tokenizer()
    h, layers, new = 32, 1, cfg.rollout.max_new_tokens
    build_model(tok, h, layers, 2, seed=0).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    few = "+task.max_train=64"                          # fewer prompts to render: faster
    common = ["model=hf", few, f"model.name_or_path={tmp_path / 'm'}", f"run.output_dir={tmp_path / 'r'}"]
    system = " ".join(["be brief"] * 10)
    chat_opts = ["task.prompt_format=chat", f"task.system_prompt='{system}'"]
    raw, chat = longest_prompt(tok, few), longest_prompt(tok, few, *chat_opts)
    assert chat > raw + 20                            # the template and system prompt add tokens
    rows = cfg.trainer.prompts_per_step * cfg.algo.group_size // cfg.algo.minibatches
    outs = {}
    for n, extra in ((raw, []), (chat, chat_opts)):
        out = dry_run(*common, *extra)
        assert f"prompts of {n} tokens, the longest" in " ".join(out.split()), out
        assert row(out, "activations (rough)") == round(16 * h * layers * rows * (n + new) * 4 / MIB, 1)
        outs[n] = row(out, "activations (rough)")
    assert outs[chat] > outs[raw]
    assert not (tmp_path / "r").exists()


def test_logits_term_counts_the_kept_head_logits():
    """The fused head's logits, by hand for SmolLM2's vocabulary (49152) and 4 x 8 rows of 49
    prompt + 32 new tokens: two chunk buffers of 2^22 floats, the sampler's [32, V] logits,
    and the learner's kept logits: a micro-batch's completion tokens x V floats while they fit
    2^24 (8 rows x 32 = 256 tokens: all kept), else whole chunks of 2^22 // V = 85 rows."""
    from rlctl.train.dryrun import MemorySettings, memory_estimate

    v = 49152

    def logits(mb_rows: int) -> float:
        s = MemorySettings(max_new_tokens=32, prompts_per_step=4, group_size=8, minibatches=1,
                           micro_batch_size=mb_rows, micro_batch_tokens=0, activation_mb=0,
                           num_processes=1, backend="torch", precision="fp32", zero_stage=0,
                           dtype="float32", gradient_checkpointing=False, lora=True,
                           reference=False, prompt_tokens=49)
        return memory_estimate(s, 1, 1, 576, 30, vocab=v, fused=True)["logits"]

    assert logits(8) == (2 * 2 ** 22 + 32 * v + 8 * 32 * v) * 4
    # 32 rows x 32 = 1024 tokens x V > 2^24: 341 rows fit, kept as 4 whole chunks of 85 rows
    assert logits(32) == (2 * 2 ** 22 + 32 * v + 4 * 85 * v) * 4
