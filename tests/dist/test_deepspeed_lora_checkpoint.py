"""A DeepSpeed LoRA checkpoint leaves the frozen base out (exclude_frozen_parameters) and is
loaded non-strictly; every trainable weight must still be in it: a resume works, and a
checkpoint that lost an adapter weight is one line (exit 2), not adapters left at their init."""
import torch


def test_deepspeed_lora_checkpoint_resumes_and_refuses_a_missing_adapter(tmp_path, rlctl_app):
    run = tmp_path / "r"
    common = ("hardware=deepspeed", "hardware.zero_stage=2", "model.lora.enabled=true",
              "trainer.eval_every=0", "logger=jsonl")
    done = rlctl_app("train", *common, "trainer.steps=1", "trainer.checkpoint_every=1",
                     f"run.dir={run}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    states = run / "checkpoints" / "step-00000001" / "deepspeed" / "mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=False)
    adapters = [k for k in saved["module"] if "lora_" in k]
    frozen = [k for k in saved["module"] if "base_layer" in k or "embed_tokens" in k]
    assert adapters and not frozen, frozen          # the frozen base is left out
    done = rlctl_app("train", "--resume", str(run), "trainer.steps=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    states = run / "checkpoints" / "step-00000002" / "deepspeed" / "mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=False)
    del saved["module"][adapters[0]]
    torch.save(saved, states)
    done = rlctl_app("train", "--resume", str(run), "trainer.steps=3", cwd=tmp_path)
    assert done.returncode == 2 and "missing" in done.stderr and adapters[0] in done.stderr, \
        done.stderr
