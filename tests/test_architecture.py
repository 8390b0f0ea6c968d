"""The package's shape: imports flow one way (no cycles, function-level imports included),
no references to files outside the repository; a warning for a very long module or function."""
from __future__ import annotations

import ast
import re
import sys
import warnings
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "rlctl"
WARN_MODULE_LINES = 800
WARN_FUNCTION_LINES = 120


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph():
    """{module: set of rlctl modules it imports anywhere (top level or inside functions, or by
    name: ``importlib.import_module("rlctl....")``, a feature imported where a run chooses it)}."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        deps = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, node, is_pkg)
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif _imports_by_name(node):
                names = [node.args[0].value]
            else:
                continue
            for name in names:
                # the longest prefix that is a module of the package, and every package above
                # it (importing a.b.c runs a/__init__.py and a/b/__init__.py first)
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                while name:
                    if name != mod and name in mods:
                        deps.add(name)
                    name = name.rpartition(".")[0]
        graph[mod] = deps
    return graph


def _imports_by_name(node) -> bool:
    """``import_module("<constant>")`` or ``importlib.import_module("<constant>")``."""
    return (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module")


def test_imports_by_name_are_edges(tmp_path, monkeypatch):
    pkg = tmp_path / "rlctl"
    pkg.mkdir()
    (pkg / "a.py").write_text("import importlib\n\n\ndef f():\n    "
                              "return importlib.import_module('rlctl.b')\n")
    (pkg / "b.py").write_text("from rlctl import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    graph = import_graph()
    assert graph["rlctl.a"] == {"rlctl.b"} and find_cycle(graph) is not None


def _is_ancestor_package(a: str, b: str) -> bool:
    """Importing a.b runs a/__init__.py: that edge is the package's own, not a cycle."""
    return b.startswith(a + ".")


def find_cycle(graph):
    """One import cycle as a list of modules, or None (iterative DFS)."""
    state = {}
    for root in graph:
        if state.get(root):
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
                continue
            if _is_ancestor_package(nxt, node):
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def long_code(modules, module_lines=WARN_MODULE_LINES, function_lines=WARN_FUNCTION_LINES):
    """'module (lines)' and 'module.function (lines)' past the limits, for {module: path}."""
    long = []
    for mod, path in modules.items():
        src = path.read_text()
        if (n := len(src.splitlines())) > module_lines:
            long.append(f"{mod} ({n})")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > function_lines:
                    long.append(f"{mod}.{node.name} ({n})")
    return long


def test_long_code_finder_finds_planted_ones(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    a = 1\n    return a\n\n\ndef g():\n    pass\n")
    assert long_code({"m": tmp_path / "m.py"}, module_lines=6, function_lines=2) == [
        "m (7)", "m.f (3)"]


def test_modules_and_functions_stay_readable():
    """A warning, not a failure: split a module past ~800 lines or a function past ~120."""
    long = long_code(_modules())
    if long:
        warnings.warn(f"over {WARN_MODULE_LINES} lines per module or {WARN_FUNCTION_LINES} "
                      f"per function: {', '.join(long)}", stacklevel=1)


def _repo_text_files():
    root = PKG.parent
    yield from (p for p in PKG.rglob("*") if p.suffix in (".py", ".yaml"))
    for folder in ("tests", "recipes", "docs", "bench", "examples", "scripts"):
        yield from (p for p in (root / folder).rglob("*") if p.suffix in (".py", ".yaml", ".md"))
    yield from (root / name for name in ("README.md", "pyproject.toml", ".ci/run"))


def test_no_references_outside_the_repository():
    # the project's specification documents and design notes live outside the repository
    banned = re.compile(r"seeds? 00\d|[Ss]eed-00\d|seeds?/|seed doc|DESIGN\.md|STACK\.md|\.\./shared|shared/seeds")
    hits = [f"{p.relative_to(PKG.parent)}:{i}: {line.strip()}"
            for p in _repo_text_files() if p != Path(__file__).resolve()
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if banned.search(line)]
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


# Imports inside functions hide the dependency graph. Allowed only (a) in the CLI's lazy
# boundary, which keeps `rlctl --help` from importing torch, and (b) for heavy optional
# dependencies, each with a comment on its line saying why.
LAZY_BOUNDARY = {"rlctl.cli"}
OPTIONAL_HEAVY = {"deepspeed", "peft", "wandb", "matplotlib", "pyarrow", "math_verify", "uvicorn",
                  "transformers", "torch", "typer"}


def function_level_imports(path: Path):
    """(line number, top-level module name, has a comment) of each import inside a function."""
    src = path.read_text()
    lines = src.splitlines()
    found = {}
    for fn in ast.walk(ast.parse(src)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    name = node.names[0].name
                elif isinstance(node, ast.ImportFrom):
                    name = node.module or "" if node.level == 0 else "rlctl"
                else:
                    continue
                found[node.lineno] = (name.split(".")[0], "#" in lines[node.lineno - 1])
    return [(n, top, commented) for n, (top, commented) in sorted(found.items())]


def test_function_level_imports_only_where_allowed():
    bad = []
    for mod, path in _modules().items():
        if mod in LAZY_BOUNDARY:
            continue
        for line, top, commented in function_level_imports(path):
            if top not in OPTIONAL_HEAVY or (not commented and top in ("transformers", "torch", "typer")):
                bad.append(f"{path.relative_to(PKG.parent)}:{line} ({top})")
    assert not bad, "imports inside functions (move them to the top, or comment why): " + ", ".join(bad)


def test_function_level_import_rule_can_fail(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from rlctl.run import training\n    import torch\n"
                   "    import peft\n    import torch  # needs CUDA only\n")
    assert function_level_imports(src) == [(2, "rlctl", False), (3, "torch", False),
                                           (4, "peft", False), (5, "torch", True)]


# ---- the composed config is read once, at the boundary ------------------------------------
# The boundary reads the composed config: the CLI, the commands, composition and the schema,
# the builders (modules named build*.py) and converters named ``from_config``. Everything
# else takes typed settings or plain arguments. These functions below the boundary still
# take the whole config, each for the reason given; a new one (or one gone) fails the test
# until this table says why.
BOUNDARY = ("rlctl/cli.py", "rlctl/config/", "rlctl/rm/settings.py")  # compose, checks, the rm config
TAKES_THE_CONFIG = {
    "rlctl/train/sources.py:build_source": "the rollout source: an asynchronous one "
        "ships the whole resolved config to its local engine processes, which build from it",
}


def config_takers(root: Path = PKG):
    """'path:function' of every function below the boundary with a parameter that is the
    composed config: named cfg or config, or annotated DictConfig."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel.startswith(BOUNDARY) or "/commands/" in rel or path.name.startswith("build"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name == "from_config":
                continue
            a = node.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs:
                ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg in ("cfg", "config") or "DictConfig" in ann:
                    found.append(f"{rel}:{node.name}")
                    break
    return found


def test_config_taker_finder_finds_planted_ones(tmp_path):
    pkg = tmp_path / "rlctl"
    (pkg / "learner").mkdir(parents=True)
    (pkg / "learner" / "m.py").write_text(
        "def a(cfg): pass\ndef b(x, *, config=None): pass\ndef c(x: 'DictConfig'): pass\n"
        "def from_config(cfg): pass\ndef d(settings): pass\n")
    (pkg / "learner" / "build_x.py").write_text("def e(cfg): pass\n")
    assert config_takers(pkg) == ["rlctl/learner/m.py:a", "rlctl/learner/m.py:b",
                                  "rlctl/learner/m.py:c"]


def test_the_config_is_read_at_the_boundary():
    found = config_takers()
    modules = {f.split(":")[0] for f in found}
    assert len(found) <= 10 and len(modules) <= 3, (len(found), sorted(modules))
    new = sorted(set(found) - set(TAKES_THE_CONFIG))
    gone = sorted(set(TAKES_THE_CONFIG) - set(found))
    assert not new, f"these take the whole config below the boundary (give them settings): {new}"
    assert not gone, f"no longer take the config (remove them from TAKES_THE_CONFIG): {gone}"


# ---- rooms: every folder (and top-level module) has its job and its imports in the docs ----
ARCH_DOC = PKG.parent / "docs" / "architecture.md"


def room_of(mod: str) -> str:
    """rlctl.train.update -> 'learner'; rlctl.errors -> 'errors.py'; rlctl -> ''."""
    parts = mod.split(".")[1:]
    if not parts:
        return ""
    return parts[0] if (PKG / parts[0]).is_dir() else parts[0] + ".py"


def room_graph(graph=None):
    """{room: rooms it imports}, the package's own __init__ left out."""
    rooms = {}
    for mod, deps in (graph or import_graph()).items():
        a = room_of(mod)
        if a:
            rooms.setdefault(a, set()).update(r for r in map(room_of, deps) if r and r != a)
    return rooms


def documented_rooms(text: str):
    """{room: (job, set of rooms it may import)} from the rows of docs/architecture.md's
    room table: | `rlctl/room/` or `rlctl/room.py` | job | `a`, `b.py` or - |."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`rlctl/(\w+)(/|\.py)`", cells[0]) if len(cells) == 3 else None
        if m:
            room = m.group(1) + (".py" if m.group(2) == ".py" else "")
            rows[room] = (cells[1], set(re.findall(r"`([\w.]+)`", cells[2])))
    return rows


def test_room_table_parser_reads_rows():
    rows = documented_rooms("| `rlctl/core/` | the math | `registry.py` |\n"
                            "| `rlctl/errors.py` | exceptions | - |\n| not | a | row |\n")
    assert rows == {"core": ("the math", {"registry.py"}), "errors.py": ("exceptions", set())}


def test_every_room_has_its_job_and_imports_in_the_docs():
    doc = documented_rooms(ARCH_DOC.read_text())
    rooms = room_graph()
    missing = sorted(set(rooms) - set(doc))
    assert not missing, f"docs/architecture.md has no row for: {missing}"
    stale = sorted(set(doc) - set(rooms))
    assert not stale, f"docs/architecture.md describes rooms that do not exist: {stale}"
    empty = [r for r, (job, _) in doc.items() if not job]
    assert not empty, f"rows without a job: {empty}"
    undocumented = {r: sorted(deps - doc[r][1]) for r, deps in rooms.items() if deps - doc[r][1]}
    assert not undocumented, f"imports the room table does not list: {undocumented}"


def test_rooms_import_one_way():
    cycle = find_cycle(room_graph())
    assert cycle is None, "rooms import each other in a cycle: " + " -> ".join(cycle)
