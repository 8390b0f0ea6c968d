"""Load a causal LM and its tokenizer (left padding, a pad token): tiny, any HF checkpoint, GGUF."""
from __future__ import annotations

import ctypes
import platform
import importlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Tuple

import torch
import transformers
from safetensors import SafetensorError
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlctl.models.gguf import gguf_file, gguf_problem, load_gguf
from rlctl.models.hf_files import adapter_problem, corrupt_safetensors, vocab_problem
from rlctl.demo.tiny import AGENT_TASKS, build_tiny, cache_root

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODELS = ("tiny", "hf")
HUB_COPIES = "hub_copies.json"     # in the rlctl cache: {hub id: directory name in the cache}
MAKERS = {"HuggingFaceTB/SmolLM2-135M-Instruct": "scripts/get-smollm2"}   # who writes a copy


def record_hub_copy(hub_id: str, path: Path) -> None:
    """Record ``path`` (a directory in the rlctl cache) as the local copy of ``hub_id``."""
    index = cache_root() / HUB_COPIES
    try:
        known = json.loads(index.read_text()) if index.is_file() else {}
    except (OSError, ValueError):                # an unreadable index is rewritten
        known = {}
    known[hub_id] = Path(path).name
    tmp = index.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
    os.replace(tmp, index)                  # atomic: a reader sees the old or the new index


def hub_copy(hub_id: str) -> Optional[Path]:
    """The rlctl cache's recorded copy of ``hub_id`` (a directory), or None."""
    index = cache_root() / HUB_COPIES
    try:
        name = json.loads(index.read_text()).get(hub_id) if index.is_file() else None
    except (OSError, ValueError):
        return None
    path = cache_root() / name if isinstance(name, str) else None
    return path if path is not None and (path / "config.json").is_file() else None


def resolve_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}'; valid: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _local_dir(name_or_path: str) -> Optional[Path]:
    """The model directory, or None for a hub id; ValueError for a missing local path."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if (os.path.isabs(name_or_path) or name_or_path.startswith((".", "~"))
            or name_or_path.count("/") > 1 or os.sep in name_or_path and os.sep != "/"):
        raise ValueError(f"model path '{name_or_path}' does not exist or is not a directory")
    return None


def quiet_libraries(device: str, num_threads: int) -> None:
    """Before loading: no transformers progress bars or info logs; ``num_threads`` threads;
    on the CPU, freed memory kept for reuse (``keep_freed_memory``)."""
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # transformers may import deepspeed
        keep_freed_memory()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(num_threads)


def keep_freed_memory() -> bool:
    """glibc on Linux: freed blocks up to 1 GiB (32 MiB where an older glibc caps the mmap
    threshold) stay in the process, so the activations and gradients a CPU step allocates
    again at every micro-batch reuse pages instead of faulting fresh zeroed ones in (the
    RSS stays near its peak between steps). A user's MALLOC_*_ or GLIBC_TUNABLES malloc
    settings win; False when nothing was set (another libc or platform)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc" or \
            any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) or \
            "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mmap = any(mallopt(M_MMAP_THRESHOLD, size) for size in (1 << 30, 32 << 20))
    return bool(mallopt(M_TRIM_THRESHOLD, 1 << 30)) and mmap


def build_tiny_model(warmup_task: Optional[str] = "sorting", **kwargs) -> Path:
    """The tiny model's directory for ``warmup_task`` (an environment's agent model or not)."""
    if warmup_task in AGENT_TASKS:
        kwargs.pop("warmup_num_digits", None)
        agents = importlib.import_module("rlctl.demo.tiny_agents")
        return agents.build_agent_tiny(warmup_task, **kwargs)
    return build_tiny(warmup_task=warmup_task, **kwargs)


def prepare_tokenizer(tokenizer, model):
    """``tokenizer`` with left padding and a pad token (EOS if none), ids shared with ``model``."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        if gen.pad_token_id is None:
            gen.pad_token_id = tokenizer.pad_token_id
        if gen.eos_token_id is None:
            gen.eos_token_id = tokenizer.eos_token_id
    return tokenizer


def check_source(name: str, name_or_path: Optional[str]) -> None:
    """ValueError for a missing, adapter or corrupt model path or an unloadable GGUF file."""
    if name != "hf" or not name_or_path:
        return
    file = gguf_file(name_or_path)
    if file is not None:
        problem = gguf_problem(file)
        if problem:
            raise ValueError(problem)
        return
    path = _local_dir(name_or_path)
    if path is not None:
        problem = adapter_problem(path) or corrupt_safetensors(path)
        if problem:
            raise ValueError(problem)


def check_vocab(tokenizer, model, path: Any) -> None:
    """ValueError (one line) when the tokenizer has ids the model's input embeddings lack."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    problem = vocab_problem(tokenizer, getattr(embeddings, "num_embeddings", None), path)
    if problem:
        raise ValueError(problem)


def load_model_and_tokenizer(name: str, name_or_path: Optional[str] = None,
                             dtype: Any = "float32", device: Any = "cpu",
                             **tiny_kwargs) -> Tuple[Any, Any]:
    """(model, tokenizer) for "tiny" (``build_tiny``'s kwargs) or "hf" (``name_or_path``: a
    directory, GGUF file or hub id: the cache's recorded copy first, ``record_hub_copy``).
    ValueError (one line) for a bad name, dtype or path."""
    torch_dtype, file, local = resolve_dtype(dtype), None, True
    if name == "tiny":
        accepted = inspect.signature(build_tiny).parameters   # the agent models take fewer
        path = str(build_tiny_model(**{k: v for k, v in tiny_kwargs.items()
                                       if k in accepted and v is not None}))
    elif name == "hf":
        if not name_or_path:
            raise ValueError("model=hf needs model.name_or_path (a local directory, hub id or "
                             ".gguf file)")
        file = gguf_file(name_or_path)
        local = file or _local_dir(name_or_path)
        if not local and (local := hub_copy(name_or_path)):     # said: it is not the Hub's file
            print(f"model: {name_or_path} from the rlctl cache's converted copy {local}",
                  file=sys.stderr)
        path = str(local or name_or_path)           # or a hub id: "org/name", from the Hub
    else:
        raise ValueError(f"unknown model '{name}'; valid: {', '.join(MODELS)}")
    try:
        # safetensors only: a pickled .bin checkpoint can run code when loaded
        if file is not None:
            model, tokenizer = load_gguf(file, torch_dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, use_safetensors=True)
            tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, SafetensorError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, SafetensorError):   # e.g. a truncated or overwritten file
            named = corrupt_safetensors(Path(path)) if os.path.isdir(path) else None
            first = named or f"its .safetensors weights are corrupt or truncated ({first})"
        elif name == "hf" and local is None and isinstance(err, OSError):   # a hub id
            make = (f"run {MAKERS[path]}" if path in MAKERS else "give a local directory")
            first = (f"not in the rlctl cache ({cache_root()}) and not loadable from the Hub "
                     f"({first}); {make}, or allow the Hub (HF_HUB_OFFLINE unset, network)")
        raise ValueError(f"cannot load model '{path}': {first}") from err
    check_vocab(tokenizer, model, path)
    model.to(device)
    return model, prepare_tokenizer(tokenizer, model)


_NAMES = ("dropout", "pdrop")                      # substrings of a dropout probability's name
_EXACT = ("layerdrop", "jitter_noise", "input_jitter_noise", "moe_jitter_eps")


def _is_rate(name: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
        return False
    name = name.lower()
    return name in _EXACT or any(s in name for s in _NAMES)


def _configs(model: nn.Module) -> Iterator:
    """Every config object the model's modules hold, nested ones included (each once)."""
    seen, todo = set(), [getattr(m, "config", None) for m in model.modules()]
    while todo:
        conf = todo.pop()
        if conf is None or id(conf) in seen or not hasattr(conf, "to_dict"):
            continue
        seen.add(id(conf))
        yield conf
        todo.extend(v for v in vars(conf).values() if hasattr(v, "to_dict"))


def disable_dropout(model: nn.Module) -> int:
    """Every dropout probability of ``model`` set to 0 in place (as TRL), so pi / pi_old = 1 at
    theta_old: dropout modules and floats on modules and (nested) configs named ``*dropout*``,
    ``*pdrop*``, ``layerdrop`` or a router's train-only jitter. Returns how many changed."""
    changed = 0
    for obj in [*model.modules(), *_configs(model)]:     # modules, then (nested) configs
        if isinstance(obj, (nn.modules.dropout._DropoutNd, nn.AlphaDropout)) and obj.p:
            obj.p, changed = 0.0, changed + 1
        for name, value in list(vars(obj).items()):
            if not name.startswith("_") and _is_rate(name, value):
                setattr(obj, name, 0.0)
                changed += 1
    return changed
