"""Every repository path (rlctl/..., tests/..., docs/..., bench/..., recipes/..., examples/...,
scripts/...) and every `rlctl.a.b` or `module:function` reference that a docstring or comment
under rlctl/ or a page in docs/ names exists: the file or folder is there, the module is a
file or package of the repository, and the name after it is defined in that module (read
with ast; nothing is imported)."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = r"(?:rlctl|tests|docs|bench|recipes|examples|scripts)"
# a path: a top folder, then more of it; not inside a longer path or a URL
PATH = re.compile(rf"(?<![\w./~$-]){TOP}/[\w./-]*(?::\w+)?")
# a dotted reference: rlctl.a.b, optionally :name
DOTTED = re.compile(r"(?<![\w./-])rlctl(?:\.\w+)+(?::\w+)?")
# a module file named without its top folder: train/update.py (under rlctl/ or beside the
# naming file), update.py (in a docstring or comment of the package: any file of that name)
RELATIVE = re.compile(rf"(?<![\w./~$-])(?!{TOP}/)\w+(?:/\w+)*\.py(?::\w+)?\b")
# not the repository's: the weight kind's key in safetensors metadata, other projects' files
# (CleanRL's ppo.py, vLLM's and SGLang's sources); examples of a user's file start with
# path/ or my
NOT_OURS = {"rlctl.kind", "ppo.py", "v1/engine/parallel_sampling.py",
            "srt/sampling/sampling_params.py"}
EXAMPLE = re.compile(r"path/|my\w*\.py")


def _names(body) -> dict[str, ast.AST]:
    """The names a module or class body defines: defs, classes, assignments, imports, and in a
    class the attributes its methods set on self."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for sub in getattr(node, block, []):
                    out.update(_names(sub.body if isinstance(sub, ast.ExceptHandler) else [sub]))
    return out


def _class_names(cls: ast.ClassDef) -> dict[str, ast.AST]:
    out = _names(cls.body)
    for fn in cls.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                        and n.value.id == "self" and isinstance(n.ctx, ast.Store)):
                    out.setdefault(n.attr, n)
    return out


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _defines(path: Path, names: list[str]) -> bool:
    """Whether the module at `path` defines names[0] (and a class there names[1], ...)."""
    scope = _names(_tree(path).body)
    for name in names:
        node = scope.get(name)
        if node is None:
            return False
        if not isinstance(node, ast.ClassDef):
            return True        # attributes of functions and values are not checked
        scope = _class_names(node)
    return True


def _module_file(parts: list[str], root: Path) -> Path | None:
    base = root.joinpath(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


@lru_cache(maxsize=None)
def _file_names(root: Path) -> frozenset:
    return frozenset(p.name for top in ("rlctl", "tests", "bench", "scripts", "examples")
                     for p in (root / top).rglob("*.py"))


def check_reference(ref: str, root: Path = ROOT, here: Path | None = None) -> bool:
    """Whether `ref` (a path, path.py:name, rlctl.a.b or rlctl.a:name) names something that
    exists under `root`. A path without its top folder may lie under rlctl/ or `here` (the
    naming file's folder); a bare file name, only checked with `here`, anywhere."""
    ref, _, name = ref.partition(":")
    if ref in NOT_OURS or EXAMPLE.match(ref):
        return True
    if "/" not in ref and ref.endswith(".py"):
        return here is None or ref in _file_names(root)
    if "/" in ref:
        bases = [root] if re.match(TOP + "/", ref) else [root / "rlctl"] + [here] * bool(here)
        for path in (b / ref for b in bases):
            if path.exists() or path.with_suffix(".py").is_file():
                return not name or (path.suffix == ".py" and _defines(path, [name]))
        return False
    parts = ref.split(".")
    for cut in range(len(parts), 0, -1):     # the longest prefix that is a module
        module = _module_file(parts[:cut], root)
        if module is not None:
            rest = parts[cut:] + ([name] if name else [])
            return not rest or _defines(module, rest)
    return False


def references(text: str):
    """(offset, reference) of each path or dotted reference in `text`; placeholders and
    patterns (<run>, *, {x}, ...) are left out, trailing punctuation trimmed."""
    for pattern in (PATH, DOTTED, RELATIVE):
        for m in pattern.finditer(text):
            ref = m.group(0).rstrip(".,;:-")
            end = text[m.end(): m.end() + 1]
            if end in ("*", "<", "{", "[") or ref.endswith("/.") or "..." in ref:
                continue
            yield m.start(), ref


def python_notes(src: str):
    """(line, text) of the docstrings and comments of a Python module."""
    todo = [ast.parse(src)]
    while todo:                         # statements only: docstrings are never in expressions
        node = todo.pop()
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                yield doc.lineno, doc.value.value
        for block in ("body", "orelse", "finalbody", "handlers"):
            todo.extend(n for n in getattr(node, block, ()) if isinstance(n, ast.AST))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def bad_references(files, root: Path = ROOT) -> list[str]:
    """'file:line: reference' of each reference in `files` that does not exist under `root`."""
    bad = []
    for file in files:
        text = file.read_text(encoding="utf-8")
        chunks = python_notes(text) if file.suffix == ".py" else [(1, text)]
        for line, chunk in chunks:
            for offset, ref in references(chunk):
                if not check_reference(ref, root, file.parent if file.suffix == ".py" else None):
                    at = line + chunk.count("\n", 0, offset)
                    bad.append(f"{file.relative_to(root)}:{at}: {ref}")
    return bad


def test_checker_finds_made_up_references(tmp_path):
    pkg = tmp_path / "rlctl" / "sinks"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .jsonl import read_jsonl\n")
    (pkg / "jsonl.py").write_text("class JsonlSink:\n    def __init__(self):\n"
                                  "        self.path = 1\n\ndef read_jsonl(p): pass\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "x.md"
    page.write_text("Real: rlctl/sinks/jsonl.py, `rlctl/sinks/jsonl.py:read_jsonl`,\n"
                    "rlctl.sinks.read_jsonl, rlctl.sinks.jsonl.JsonlSink.path, rlctl/sinks/,\n"
                    "rlctl/config/conf/*.yaml, rlctl/<room>/.\nMade up: rlctl/sinks/gone.py, "
                    "rlctl.sinks.jsonl.read_csv, rlctl/sinks/jsonl.py:write,\n"
                    "rlctl.sinks.jsonl.JsonlSink.nope, tests/nothing/, rlctl.nowhere:f.\n")
    assert bad_references([page], tmp_path) == [
        "docs/x.md:4: rlctl/sinks/gone.py", "docs/x.md:4: rlctl/sinks/jsonl.py:write",
        "docs/x.md:5: tests/nothing/", "docs/x.md:4: rlctl.sinks.jsonl.read_csv",
        "docs/x.md:5: rlctl.sinks.jsonl.JsonlSink.nope", "docs/x.md:5: rlctl.nowhere:f"]
    src = pkg / "m.py"
    src.write_text('"""See rlctl/sinks/jsonl.py, sinks/jsonl.py, jsonl.py and gone.py."""\n'
                   'X = "rlctl/not/checked.py"  # rlctl.gone, sinks/gone.py:f\n')
    assert bad_references([src], tmp_path) == [
        "rlctl/sinks/m.py:1: gone.py", "rlctl/sinks/m.py:2: rlctl.gone",
        "rlctl/sinks/m.py:2: sinks/gone.py:f"]


def test_docstrings_comments_and_docs_name_what_exists():
    files = [*sorted((ROOT / "rlctl").rglob("*.py")), *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "README.md"]
    bad = bad_references(files)
    assert not bad, "references to paths or names that do not exist:\n" + "\n".join(bad)
