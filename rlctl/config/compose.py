"""Compose the run config (conf + a recipe + overrides) with Hydra and validate it; one-line errors."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from rlctl.config.checks import example_value, validate
from rlctl.errors import ConfigError, one_line
from rlctl.config.schema import CONF_DIR, GROUPS, RLConfig, group_options, register_schemas, schema_fields


RENAMED = {"trainer.async": "trainer.async_rollout"}   # old names still accepted, with a notice
_TOLD_RENAMES: set = set()   # renames already announced in this process


def _renamed_notice(old: str, new: str, stream) -> None:
    if old not in _TOLD_RENAMES:
        _TOLD_RENAMES.add(old)
        print(f"rlctl: warning: {old} is deprecated, renamed {new} (e.g. {new}.enabled=true)",
              file=stream or sys.stderr, flush=True)


def rename_deprecated(overrides: List[str], recipe: Optional[Dict] = None, stream=None):
    """(overrides, recipe) with renamed keys moved to their new names; one notice a process."""
    out = []
    for o in overrides:
        key = o.lstrip("+~")
        for old, new in RENAMED.items():
            if key == old or key.startswith((old + ".", old + "=")):
                key = new + key[len(old):]
                _renamed_notice(old, new, stream)
        out.append(o[:len(o) - len(o.lstrip("+~"))] + key)
    for old, new in RENAMED.items():
        (section, leaf), (_, new_leaf) = old.split("."), new.split(".")
        node = (recipe or {}).get(section)
        if isinstance(node, dict) and leaf in node:
            _renamed_notice(old, new, stream)
            node = {(new_leaf if k == leaf else k): v for k, v in node.items()}
            recipe = {**recipe, section: node}
    return out, recipe


REWARD_KEYS = ("task.rewards", "task.reward_fn")   # values are path/file.py:fn specs


def _quoted(text: str) -> str:
    return f'"{text}"' if '"' not in text else f"'{text}'"


def reward_specs(overrides: List[str]) -> List[str]:
    """The reward overrides as Hydra and the schema take them: a spec Hydra's grammar
    rejects unquoted (``~/r.py:fn``) quoted, a lone ``task.rewards=my.py:fn`` a list."""
    parser, out = OverridesParser.create(), []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+~") in REWARD_KEYS and "{" not in value:
            quoted = f"[{','.join(_quoted(v.strip()) for v in value[1:-1].split(','))}]" \
                if value[:1] + value[-1:] == "[]" else _quoted(value)
            for text in (o, f"{key}={quoted}"):
                try:
                    parsed = parser.parse_override(text).value()
                except Exception:  # noqa: BLE001 - Hydra's grammar errors: explain() names them
                    continue
                o = f"{key}=[{_quoted(parsed)}]" if key.lstrip("+~") == "task.rewards" \
                    and isinstance(parsed, str) else text
                break
        out.append(o)
    return out


# the phrases of Hydra's override grammar errors (from its ANTLR parser)
GRAMMAR_ERRORS = ("mismatched input", "no viable alternative", "extraneous input", "missing EQUAL",
                  "token recognition error")


def grammar_message(msg: str, overrides: Sequence[str]) -> str:
    """Hydra's override grammar error as one line: which override, and what it looks like."""
    m = re.search(r"Error parsing override '([^']*)'", msg)
    bad = m.group(1) if m else _first_unparsable(overrides)
    reason = re.search(r"(mismatched input|no viable alternative at input|extraneous input|"
                       r"missing EQUAL at|token recognition error at:) ?('[^']*')?", msg)
    why = f" ({reason.group(1)} {reason.group(2) or ''})".replace(" )", ")") if reason else ""
    what = f"'{bad}'" if bad is not None else "an override"
    return (f"cannot parse {what}{why}; overrides look like key=value (e.g. algo.clip_eps=0.1), "
            "a sweep (-m) lists values like seed=0,1,2")


def _first_unparsable(overrides: Sequence[str]) -> Optional[str]:
    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_override(o)
        except Exception:  # noqa: BLE001 - Hydra's grammar errors
            return o
    return None


def check_override_syntax(overrides: Sequence[str]) -> None:
    """Parse overrides with Hydra's grammar (sweep lists included); ConfigError on failure."""
    try:
        OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:  # noqa: BLE001 - Hydra's grammar errors
        raise ConfigError(grammar_message(one_line(exc), overrides)) from None


RECIPE_DIRS = (Path.cwd() / "recipes", Path(__file__).resolve().parents[2] / "recipes")


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """A config tree's leaves by dotted key: {"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    if not isinstance(tree, Mapping):
        return {prefix: tree} if prefix else {}
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


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


RECIPE_GROUP = "recipe"


def _store_recipe(recipe: Dict, overrides: Sequence[str]) -> None:
    """Register the recipe as a global config, less the groups the shell overrides."""
    chosen = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    switched = {g for g in GROUPS if g in chosen}
    body = {k: v for k, v in recipe.items() if k not in switched}
    defaults = []
    for item in body.get("defaults", []) or []:
        key = next(iter(item)) if isinstance(item, dict) else str(item)
        if key.replace("override", "").strip().lstrip("/") not in switched:
            defaults.append(item)
    body["defaults"] = defaults
    ConfigStore.instance().store(group=RECIPE_GROUP, name="replay", node=body, package="_global_")


@dataclass
class Composed:
    cfg: DictConfig              # unresolved, validated
    choices: Dict[str, Any]      # group -> chosen option, e.g. {"algo": "grpo"}, or a list
                                 # of them merged in order (logger=[jsonl,wandb])
    overrides: List[str]         # as given on the command line
    recipe: Optional[str] = None


def compose(overrides: Sequence[str] = (), recipe: Optional[str] = None) -> Composed:
    """The composed (unresolved) config, validated. Raises ConfigError."""
    given, loaded = rename_deprecated(reward_specs(list(overrides)),
                                      load_recipe(recipe) if recipe is not None else None)
    overrides = given
    register_schemas()
    if recipe is not None:
        _store_recipe(loaded, overrides)
        overrides = [f"+{RECIPE_GROUP}=replay"] + overrides
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except Exception as exc:  # noqa: BLE001 - every compose failure is a user error
        raise ConfigError(explain(exc, overrides)) from None
    finally:
        GlobalHydra.instance().clear()
    ran = cfg.hydra.runtime.choices
    choices = {g: str(ran[g]) if g in ran else _list_choice(g, given, loaded) for g in GROUPS}
    with open_dict(cfg):
        for key in ("hydra", "defaults"):
            cfg.pop(key, None)
    _check_chosen(cfg)
    validate(cfg, given, choices["algo"])
    return Composed(cfg=cfg, choices=choices, overrides=given, recipe=recipe)


def _check_chosen(cfg) -> None:
    """Every group has an option (``logger=[]`` chooses none): ConfigError naming the valid ones."""
    for group in GROUPS:
        if OmegaConf.is_missing(cfg[group], "name"):
            many = "one or more" if group == "logger" else "one"
            raise ConfigError(f"no {group} chosen ({group}=[]); choose {many} of: "
                              f"{', '.join(group_options(group))}")


def _list_choice(group: str, overrides: Sequence[str], recipe: Optional[Dict]) -> List[str]:
    """A group's options given as a list (logger=[jsonl,wandb]): the shell's, else the recipe's."""
    for o in reversed(OverridesParser.create().parse_overrides(list(overrides))):
        if o.key_or_group == group and isinstance(o.value(), list):
            return [str(v) for v in o.value()]
    for item in (recipe or {}).get("defaults", []) or []:
        for key, value in (item.items() if isinstance(item, dict) else []):
            if key.replace("override", "").strip().lstrip("/") == group and isinstance(value, list):
                return [str(v) for v in value]
    return []


def explain(exc: Exception, overrides: Sequence[str]) -> str:
    """Turn Hydra/OmegaConf exceptions into one line naming the key and valid values."""
    parts, seen = [], exc
    while seen is not None and len(parts) < 5:
        parts.append(one_line(seen))
        seen = seen.__cause__ or seen.__context__
    msg = " | ".join(parts)
    m = re.search(r"Could not (?:find|load) '(\w+)/([^']*)'", msg)  # load: in a list
    if m and m.group(1) in GROUPS:
        group, bad = m.groups()
        return f"unknown {group} '{bad}'; valid: {', '.join(group_options(group))}"
    m = re.search(r"Could not override '([^']+)'", msg) or re.search(
        r"Key '[^']+' not in '\w+' full_key: ([\w.]+)", msg)
    if m:
        return _unknown_key(m.group(1))
    m = re.search(r"full_key: ([\w.]+)", msg)
    if m and any(t in msg for t in TYPE_ERRORS):
        return _type_message(m.group(1), msg, overrides)
    if any(t in msg for t in GRAMMAR_ERRORS):
        return grammar_message(msg, overrides)
    return parts[-1] if len(parts) > 1 and "Error merging" in parts[0] else parts[0]


TYPE_ERRORS = ("could not be converted", "is not a valid bool", "is not a ListConfig",
               "is not a subclass of", "is not Optional", "Incompatible value")
KIND_NAMES = {"float": "a float", "int": "an integer", "bool": "a boolean",
              "str": "a string", "list": "a list", "any": "a value"}


def _unknown_key(key: str) -> str:
    parent, _, _ = key.rpartition(".")
    valid = _valid_keys(parent)
    hint = f"; valid keys of '{parent or 'the root'}': {', '.join(valid)}" if valid else ""
    return f"unknown config key '{key}'{hint}"


def _given_value(key: str, msg: str, overrides: Sequence[str]) -> str:
    """The value as the user typed it (the override), else as OmegaConf quotes it."""
    for o in overrides:
        k, eq, v = o.partition("=")
        if eq and k.lstrip("+~") == key:
            return v
    m = re.search(r"[Vv]alue '(.*?)'(?: of type| is not a valid| for field)", msg) \
        or re.search(r"value: (\S+)", msg)
    return m.group(1) if m else "null" if "not Optional" in msg else "?"


def _type_message(key: str, msg: str, overrides: Sequence[str]) -> str:
    """'invalid value V for KEY: expected TYPE (e.g. KEY=EXAMPLE)', from the schema."""
    spec = next((s for s in schema_fields() if s.key == key), None)
    value = _given_value(key, msg, overrides)
    if spec is None:
        return f"invalid value '{value}' for '{key}': {msg.split(' full_key')[0][-160:]}"
    if spec.kind == "group":
        keys = ", ".join(_valid_keys(key))
        return (f"invalid value '{value}' for '{key}': it is a group of keys ({keys}); set one of "
                f"them, e.g. {key}.{_valid_keys(key)[0]}=...")
    what = KIND_NAMES[spec.kind]
    if spec.kind == "list":
        what = {"str": "a list of strings", "float": "a list of floats"}.get(spec.item, "a list")
    if spec.optional:
        what += " or null"
    elif value in ("null", "None"):
        what += " (null is not allowed)"
    return f"invalid value '{value}' for '{key}': expected {what} (e.g. {key}={example_value(spec)})"


def _valid_keys(parent: str) -> List[str]:
    node = OmegaConf.structured(RLConfig)
    try:
        sub = OmegaConf.select(node, parent) if parent else node
    except Exception:  # noqa: BLE001 - best-effort hint only
        return []
    return sorted(k for k in sub.keys() if k != "defaults") if isinstance(sub, DictConfig) else []
