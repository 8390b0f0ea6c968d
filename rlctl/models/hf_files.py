"""Checks of a model directory's files that load nothing (no torch), each problem one line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from safetensors import SafetensorError, safe_open


def adapter_problem(path: Path, new_adapter: bool = True) -> Optional[str]:
    """One line when ``path`` is a LoRA adapter, not a whole model, saying what to pass instead."""
    path = Path(path)
    if not (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        return None
    try:
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    run = path.parent if (path.parent / "config.yaml").is_file() else path
    base_hint = f"its base model ({base})" if base else "the base model it was trained on"
    lora = " (with model.lora.enabled=true for a new adapter)" if new_adapter else ""
    return (f"'{path}' is a LoRA adapter (adapter_config.json), not a whole model; pass "
            f"{base_hint} as model.name_or_path{lora}, or give '{run}' as the TARGET of "
            "rlctl eval or rlctl rollout to use the adapter")


def corrupt_safetensors(path: Path) -> Optional[str]:
    """One line naming the first .safetensors file in ``path`` whose header cannot be read."""
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as exc:
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return f"'{file}' is corrupt or truncated, not a readable safetensors file ({why})"
    return None


def vocab_problem(tokenizer, rows: Optional[int], path: Any) -> Optional[str]:
    """One line when text, a special token or the chat template can reach an id beyond the
    model's ``rows`` input embeddings (added tokens only their literal text makes are fine)."""
    if not isinstance(rows, int):
        return None
    added = tokenizer.get_added_vocab()                  # token -> id, matched only literally
    if len(tokenizer) <= rows and all(i < rows for i in added.values()):
        return None
    roles = [(name, tok) for name in ("pad", "bos", "eos", "unk")
             if (tok := getattr(tokenizer, f"{name}_token", None)) is not None]
    template = str(getattr(tokenizer, "chat_template", None) or "")
    harmful = {tok: i for tok, i in tokenizer.get_vocab().items() if i >= rows and (
        tok not in added or tok in dict(roles).values() or (template and tok in template))}
    if not harmful:
        return None
    beyond = [f"{name} token {tok!r} is id {harmful[tok]}" for name, tok in roles if tok in harmful]
    beyond = beyond or [f"token {tok!r} is id {i}" for tok, i in sorted(
        harmful.items(), key=lambda kv: kv[1])[:3]]
    return (f"the tokenizer in '{path}' has {len(tokenizer)} tokens but the model's input "
            f"embeddings have {rows} rows ({'; '.join(beyond)})"
            + ": resize them (model.resize_token_embeddings(len(tokenizer))) and save again, "
            "or use a tokenizer within them (e.g. the EOS as pad)")


def reward_model_dir(path: Path) -> Path:
    """``path``, or its ``model/`` for a run directory of `rlctl reward-model train`."""
    path = Path(path)
    if not (path / "config.json").is_file() and (path / "model" / "config.json").is_file():
        return path / "model"
    return path
