"""Light file helpers shared by the commands (no torch: `rlctl inspect` imports them)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from rlctl.errors import UserError


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.yaml").is_file()


def write_json(path: Path, data) -> Path:
    """``data`` as indented JSON, written atomically to ``path``; an OS error is one line."""
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, allow_nan=False))
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write '{path}': {exc.strerror or exc}") from None
    return path
