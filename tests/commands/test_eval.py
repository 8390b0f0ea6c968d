"""`rlctl eval` on a run dir, a model dir, a LoRA adapter and the configured model."""
import json

import pytest

DESIGNS = ("exact", "positional", "inclusion_order")
TOP_KEYS = {"target", "target_kind", "model", "run_dir", "task", "reward_name", "split",
            "num_prompts", "samples", "temperature", "top_k", "max_new_tokens", "seed",
            "stop_token_ids", "overrides", "greedy", "sampled", "eval", "seconds", "reward_label",
            "reward_norm", "reward_models"}
METRICS = {"exact_match", "reward", "length_mean", "truncated_frac", "well_formed",
           *(f"reward/{d}" for d in DESIGNS)}


def test_eval_run_dir_writes_every_key(cli, run_a):
    res = cli("eval", run_a, "--samples", "2")
    assert res.exit_code == 0, res.output
    data = json.loads((run_a / "eval.json").read_text())
    assert set(data) == TOP_KEYS
    assert set(data["greedy"]) == METRICS
    assert set(data["sampled"]) == METRICS | {"pass@1", "pass@2"}
    assert data["target_kind"] == "run" and data["num_prompts"] == 32 and data["samples"] == 2
    for part in ("greedy", "sampled"):
        for key in ("exact_match", "truncated_frac", "reward/exact", "reward/positional"):
            assert 0.0 <= data[part][key] <= 1.0, (part, key)
        # the configured reward (positional) is one of the designs
        assert data[part]["reward"] == pytest.approx(data[part]["reward/positional"])
        # exact-match and the exact reward design are the same thing
        assert data[part]["reward/exact"] == pytest.approx(data[part]["exact_match"])
    s = data["sampled"]
    assert s["pass@1"] == pytest.approx(s["exact_match"])
    assert s["pass@1"] <= s["pass@2"] <= 1.0
    # greedy eval of the saved model reproduces the trainer's final in-memory eval
    end = json.loads((run_a / "summary.json").read_text())["eval_end"]
    assert data["greedy"]["exact_match"] == pytest.approx(end["eval/exact_match"], abs=1e-9)
    assert data["greedy"]["reward"] == pytest.approx(end["eval/reward"], abs=1e-6)
    assert "greedy" in res.stdout and "pass@2" in res.stdout and "eval.json" in res.stdout


def test_eval_without_target_uses_configured_model(cli, tmp_path):
    res = cli("eval", "task.num_eval=16", "rollout.max_new_tokens=6", cwd=tmp_path)
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "eval-tiny.json").read_text())
    assert data["target_kind"] == "config" and data["target"] is None
    assert data["num_prompts"] == 16 and data["max_new_tokens"] == 6
    assert 0.0 <= data["greedy"]["exact_match"] <= 1.0
    assert "pass@1" in data["sampled"] and "pass@2" not in data["sampled"]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft on transformers 5
def test_eval_model_dir_and_zero_lora_adapter_match_the_run(cli, run_a, tmp_path):
    """A model dir inside a run uses that run's config; a zero-initialised LoRA adapter
    (B = 0) on that model must give exactly the base model's greedy metrics."""
    peft = pytest.importorskip("peft")
    from rlctl.models.loading import load_model_and_tokenizer

    res = cli("eval", run_a / "model", "--out", tmp_path / "model.json")
    assert res.exit_code == 0, res.output
    base = json.loads((tmp_path / "model.json").read_text())
    assert base["target_kind"] == "model" and base["run_dir"] == str(run_a)
    assert base["num_prompts"] == 32  # from the run's task.num_eval, not the default 256

    model, _ = load_model_and_tokenizer("hf", name_or_path=str(run_a / "model"))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(tmp_path / "adapter")
    res = cli("eval", tmp_path / "adapter", "task.num_eval=32", "--out", tmp_path / "lora.json")
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "lora.json").read_text())
    assert data["target_kind"] == "adapter" and "LoRA" in data["model"]
    assert data["greedy"] == pytest.approx(base["greedy"])
