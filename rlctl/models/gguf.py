"""GGUF checkpoints (llama.cpp's one-file format) as models: found, checked (one line per
problem), loaded dequantised through transformers' GGUF loader, and ``convert_gguf`` to a
Hugging Face directory. The ``gguf`` extra is imported only here, when a file is loaded."""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Optional, Tuple

import torch
import transformers.modeling_gguf_pytorch_utils as hf_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
from transformers.integrations.gguf import GGUF_ARCHS
from transformers.utils import logging as hf_logging

EXTRA = "pip install 'rlctl[gguf]' (or pip install gguf==0.19.0)"


def gguf_file(name_or_path: str) -> Optional[Path]:
    """The .gguf file ``name_or_path`` names (the file, or a directory's only .gguf and no
    config.json), else None; ValueError (one line) for a directory of several."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"'{path}' holds {len(files)} .gguf files and no config.json; name one "
                         f"as model.name_or_path (e.g. {files[0]})")
    return files[0] if files else None


def _supported() -> Tuple[set, set]:
    """(architectures, tensor types) transformers' GGUF loader reads with this gguf."""
    quants = importlib.import_module("gguf.quants")   # the optional extra: only for a GGUF file
    archs = set(hf_gguf.GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_ARCHS) | {"qwen2moe", "qwen3moe",
                                                                   "gpt-oss", "minimax-m2"}
    archs -= {"general", "tokenizer"}                  # metadata groups, not architectures
    return archs, {"F32", "F16"} | {t.name for t in quants._type_traits}


def gguf_problem(file: Path) -> Optional[str]:
    """One line when ``file`` cannot be loaded (no gguf package, damaged, unsupported), else None."""
    try:
        gguf = importlib.import_module("gguf")      # the optional extra: only for a GGUF file
    except ImportError:
        return f"'{file}' is a GGUF file, and loading one needs the gguf package: {EXTRA}"
    try:
        reader = gguf.GGUFReader(str(file))
        arch = str(reader.fields["general.architecture"].contents())
        types = {t.tensor_type.name for t in reader.tensors}
    except Exception as exc:   # noqa: BLE001 - any parse failure (struct, numpy, key, value)
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"'{file}' is corrupt or truncated, not a readable GGUF file ({why})"
    archs, kinds = _supported()
    if arch not in archs:
        return (f"'{file}' has GGUF architecture '{arch}', which transformers cannot load; "
                f"supported: {', '.join(sorted(archs))}")
    if types - kinds:
        return (f"'{file}' holds tensors of type {', '.join(sorted(types - kinds))}, which "
                f"cannot be dequantised; supported: {', '.join(sorted(kinds))}")
    return None


def load_gguf(file: Path, dtype: torch.dtype = torch.float32) -> Tuple[Any, Any]:
    """(model, tokenizer) from a GGUF ``file``, dequantised, then cast to ``dtype``, a plain model
    that saves as safetensors. ValueError (one line) for a file ``gguf_problem`` names."""
    problem = gguf_problem(file)
    if problem:
        raise ValueError(problem)
    hf_gguf.tqdm = hf_logging.tqdm     # the dequantising bar obeys quiet_libraries' switch
    model = AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=dtype,
        quantization_config=GgufConfig(dequantize=True))   # dense, and no quantizer kept
    return model, AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)


def convert_gguf(file: os.PathLike, out_dir: os.PathLike) -> Path:
    """Write GGUF ``file`` as a float32 Hugging Face directory ``out_dir``; returns ``out_dir``."""
    model, tokenizer = load_gguf(Path(file), torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)
