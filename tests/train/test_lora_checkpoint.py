"""A LoRA run's checkpoints hold the trainable state only (adapters, value head, their
AdamW moments, RNG, trainer state), not the frozen base, and a resume from one still ends
exactly as the uninterrupted run (the base is rebuilt from the run's config)."""
import json
import shutil
from pathlib import Path

from rlctl.models.loading import load_model_and_tokenizer
from rlctl.models.lora import apply_lora

STEPS = 2
ARGS = [f"trainer.steps={STEPS}", "trainer.checkpoint_every=1", "trainer.eval_every=0",
        "trainer.prompts_per_step=2", "algo=ppo", "algo.group_size=2", "logger=jsonl",
        "logger.console=false", "run.save_model=false", "rollout.max_new_tokens=4",
        "model.lora.enabled=true", "model.lora.r=2", "model.lora.alpha=4",
        "model.lora.target_modules=[q_proj,v_proj]"]


def _metrics(run: Path):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))}
            for r in rows if "step" in r}


def test_lora_checkpoint_holds_only_the_trainable_state_and_resumes_exactly(rlctl_app, tmp_path):
    full = tmp_path / "full"
    done = rlctl_app("train", *ARGS, f"run.dir={full}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr

    # the bound, from the counted parameters: fp32 adapters + value head, and AdamW's two
    # fp32 moments of each; the margin is 2 KiB per tensor (safetensors header entry, the
    # optimizer's pickle records) plus 32 KiB for the RNG (~10 KiB), schedule and state files
    base, _ = load_model_and_tokenizer("tiny")
    base_bytes = 4 * sum(p.numel() for p in base.parameters())
    lora = apply_lora(base, r=2, alpha=4, dropout=0.0, target_modules=["q_proj", "v_proj"])
    trained = [p for p in lora.parameters() if p.requires_grad]
    hidden = base.config.hidden_size
    n_train = sum(p.numel() for p in trained) + hidden + 1            # + the value head
    n_tensors = len(trained) + 2
    bound = 3 * 4 * n_train + 2048 * n_tensors + 32 * 1024
    ckpt = full / "checkpoints" / f"step-{STEPS:08d}"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    assert size < bound, (size, bound)
    assert size * 10 < base_bytes, (size, base_bytes)

    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / f"step-{STEPS:08d}")       # as if stopped after step 1
    (cut / "summary.json").unlink()
    done = rlctl_app("train", "--resume", str(cut), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    uninterrupted, resumed = _metrics(full), _metrics(cut)
    assert sorted(resumed) == sorted(uninterrupted) and STEPS in resumed
    for step in uninterrupted:
        assert resumed[step] == uninterrupted[step], step
