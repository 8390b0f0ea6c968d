"""Recipe files: the shipped and local recipes by name, their one-line descriptions, and
reading one into a mapping of config keys (``ConfigError`` naming the file otherwise)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import yaml

from rlctl.errors import ConfigError, one_line


RECIPE_DIRS = (Path.cwd() / "recipes", Path(__file__).resolve().parents[1] / "recipes")


def recipe_files() -> Dict[str, Path]:
    """Shipped and local recipes by name (./recipes wins over the repository's)."""
    found: Dict[str, Path] = {}
    for d in reversed(RECIPE_DIRS):
        for p in sorted(d.glob("*.yaml")) if d.is_dir() else []:
            found[p.stem] = p
    return found


def recipe_description(path: Path) -> str:
    """The first comment line after `# @package _global_`."""
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        text = line.lstrip("# ").strip()
        if line.startswith("#") and text and not text.startswith("@package"):
            return text
    return ""


def resolve_recipe(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    known = recipe_files()
    if name_or_path in known:
        return known[name_or_path]
    raise ConfigError(f"cannot read recipe '{name_or_path}': no such file or recipe name; "
                      f"recipes: {', '.join(known) or 'none'} (list them with `rlctl recipes`)")


def load_recipe(path: str) -> Dict:
    p = resolve_recipe(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read recipe '{path}': not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                          f"at offset {exc.start}); a recipe is a YAML file of config keys") from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read recipe '{path}': {one_line(exc)[:200]}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"cannot read recipe '{path}': expected a YAML mapping of config keys")
    return data
