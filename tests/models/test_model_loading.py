"""load_model_and_tokenizer: tiny (cached build) and hf (any save_pretrained directory)."""
import json
import shutil
import subprocess
import platform
import sys

import pytest
import torch

from rlctl.models.loading import load_model_and_tokenizer


def test_tiny_and_hf_give_the_same_model(tiny, tiny_dir):
    model, tok = tiny
    hf_model, hf_tok = load_model_and_tokenizer("hf", name_or_path=str(tiny_dir),
                                                hidden_size=999)  # tiny keys are ignored
    a, b = model.state_dict(), hf_model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert hf_tok.padding_side == "left" and hf_tok.pad_token_id == tok.pad_token_id == 0
    assert type(hf_model).__name__ == "LlamaForCausalLM"


def test_hf_dtype(tiny_dir):
    model, _ = load_model_and_tokenizer("hf", name_or_path=str(tiny_dir), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_hf_without_pad_token_uses_eos_and_left_padding(tiny_dir, tmp_path):
    path = tmp_path / "nopad"
    shutil.copytree(tiny_dir, path)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("pad_token")
    cfg["padding_side"] = "right"
    cfg_file.write_text(json.dumps(cfg))
    tok_file = path / "tokenizer.json"  # its saved padding section names the pad token too
    tok_json = json.loads(tok_file.read_text())
    tok_json["padding"] = None
    tok_file.write_text(json.dumps(tok_json))
    model, tok = load_model_and_tokenizer("hf", name_or_path=str(path))
    assert tok.pad_token == "<eos>" and tok.padding_side == "left"
    assert tok(["1 2 3 =", "4 ="], padding=True)["input_ids"][1][:2] == [2, 2]


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="hf", name_or_path="/no/such/model/dir"), "does not exist"),
    (dict(name="hf", name_or_path="./missing-model"), "does not exist"),
    (dict(name="hf"), "name_or_path"),
    (dict(name="gpt5"), "valid: tiny, hf"),
    (dict(name="tiny", dtype="float8"), "valid: float32, bfloat16"),
])
def test_clear_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        load_model_and_tokenizer(**kwargs)
    assert "\n" not in str(err.value)


def test_hf_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot load model") as err:
        load_model_and_tokenizer("hf", name_or_path=str(tmp_path / "empty"))
    assert "\n" not in str(err.value)


def test_a_training_run_imports_neither_the_agent_demos_nor_the_optional_sinks():
    mods = ("rlctl.demo.tiny_agents", "rlctl.sinks.wandb_sink", "rlctl.sinks.tensorboard_sink")
    code = f"import sys, rlctl.train.run; print([m for m in {mods!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_hub_id_loads_its_recorded_cache_copy_without_network(tiny_dir, tmp_path, monkeypatch):
    """scripts/get-smollm2's path: a converted directory recorded in the rlctl cache under the
    Hub id that recipes name is what that id loads, offline; without one, one line names the
    script that makes it."""
    from rlctl.models.loading import MAKERS, record_hub_copy

    hub_id = next(iter(MAKERS))
    monkeypatch.setenv("RLCTL_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read at import
    with pytest.raises(ValueError, match=f"not in the rlctl cache.*run {MAKERS[hub_id]}, or "
                                         "allow the Hub") as err:
        load_model_and_tokenizer("hf", name_or_path=hub_id)
    assert "\n" not in str(err.value)
    copy = tmp_path / "converted"
    shutil.copytree(tiny_dir, copy)
    record_hub_copy(hub_id, copy)
    record_hub_copy("org/other", copy)                  # a second record keeps the first
    model, _ = load_model_and_tokenizer("hf", name_or_path=hub_id)
    want = load_model_and_tokenizer("hf", name_or_path=str(tiny_dir))[0].state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="give a local directory"):   # no maker known
        load_model_and_tokenizer("hf", name_or_path="org/unknown")


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults(monkeypatch):
    """keep_freed_memory (set for CPU runs): a freed 64 MiB block is reused by the next one
    of that size, so filling it faults in almost no pages (fresh pages: 16384 faults)."""
    import resource

    from rlctl.models.loading import keep_freed_memory

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert not keep_freed_memory()                     # a user's setting wins
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    assert keep_freed_memory()
    n = 16 << 20                                       # under the 32 MiB an older glibc allows
    block = b"\1" * n                                  # malloc + fill: every page touched
    del block
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = b"\2" * n
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del block
    assert faults < n // 4096 // 8, faults
