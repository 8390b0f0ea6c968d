"""The documentation: README.md and the MkDocs site built from docs/.

- `mkdocs build --strict` passes with the repository's mkdocs.yml (about 2 s), and the same
  settings fail a planted broken link, a missing anchor and a page left out of the nav;
- README.md is at most 250 lines, and its links into docs/ reach a page and an anchor of the
  built site;
- every runnable fenced block (bash, sh, shell, console or no language, holding a command
  line such as `rlctl ...`, `python ...`, `scripts/...`) in README.md and docs/*.md has a
  marker right before it, either
      <!-- tested: tests/path.py::test_name [more ...] -->   tests that run its commands
                                                           (with settings that shrink them)
      <!-- not run: reason -->                             not meant to run here (GPU, SLURM, ...)
  and every test a marker names exists;
- the blocks whose marker names test_cheap_snippets_run below are run here, in process, and
  docs/extending.md's `mylosses.py` trains with the command shown beside it.
"""
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
PROGRAMS = {"rlctl", "python", "python3", "torchrun", "deepspeed", "srun", "bash", "pip", "mkdocs"}
PROGRAM_DIRS = ("scripts/", ".venv/", "./", "bench/")
ENV_ASSIGNMENT = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
TEST_REF = re.compile(r"^(tests/[\w/.-]+\.py)::(test_\w+)$")
THIS = "tests/test_docs.py"


def doc_files(root: Path = ROOT):
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def command_word(line: str) -> str:
    """The program a shell line runs ('' for a comment or blank line)."""
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    if not line or line.startswith("#"):
        return ""
    line = ENV_ASSIGNMENT.sub("", line)
    return line.split()[0] if line.split() else ""


def is_command(line: str) -> bool:
    word = command_word(line)
    return word in PROGRAMS or word.startswith(PROGRAM_DIRS)


def commands(lines):
    """The command lines of a block, continuation lines (ending in a backslash) joined."""
    joined, cur = [], ""
    for line in lines:
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if is_command(cur):
            joined.append(cur.strip().removeprefix("$ "))
        cur = ""
    return joined


def marker_before(lines, i):
    """The HTML comment that ends on the last non-blank line before line i, or None."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0 or not lines[j].rstrip().endswith("-->"):
        return None
    k = j
    while k >= 0 and "<!--" not in lines[k]:
        k -= 1
    text = " ".join(ln.strip() for ln in lines[k:j + 1])
    return text[text.index("<!--") + 4:text.rindex("-->")].strip()


def blocks(text: str):
    """(first line number, language, lines, marker) of each fenced block."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        found.append((start + 1, lang, body, marker_before(lines, start)))
        i += 1
    return found


def text_after_closing_fences(text: str):
    """Line numbers of closing fences with text after them (Markdown does not close the
    block there: the page renders as code up to the next bare fence)."""
    lines, hits, fence = text.splitlines(), [], None
    for n, line in enumerate(lines):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.startswith(fence):
            if line.strip() != fence:
                hits.append(n + 1)
            fence = None
    return hits


def indented_commands(text: str):
    """Line numbers of commands in indented (unfenced) code blocks, which no marker covers."""
    lines, hits, fenced = text.splitlines(), [], False
    for n, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
        elif (not fenced and line.startswith("    ") and n and not lines[n - 1].strip()
              and is_command(line)):
            hits.append(n + 1)
    return hits


def marker_problems(marker, root: Path):
    if marker is None:
        return ["no <!-- tested: ... --> or <!-- not run: ... --> marker before it"]
    kind, _, rest = marker.partition(":")
    if kind.strip() == "not run":
        return [] if len(rest.strip()) >= 10 else ["'not run' needs a reason"]
    if kind.strip() != "tested" or not rest.split():
        return [f"marker {marker!r} is neither 'tested: tests/x.py::test_y' nor 'not run: why'"]
    problems = []
    for ref in rest.split():
        m = TEST_REF.match(ref)
        if not m:
            problems.append(f"{ref!r} is not tests/<file>.py::test_<name>")
        elif not (root / m.group(1)).is_file():
            problems.append(f"{m.group(1)} does not exist")
        elif not re.search(rf"^\s*(async )?def {m.group(2)}\(", (root / m.group(1)).read_text(),
                           re.M):
            problems.append(f"{m.group(1)} has no def {m.group(2)}(")
    return problems


def snippet_problems(root: Path = ROOT):
    problems = []
    for path in doc_files(root):
        name, text = path.relative_to(root), path.read_text()
        for n in text_after_closing_fences(text):
            problems.append(f"{name}:{n}: text after a closing fence; put it on its own line")
        for n in indented_commands(text):
            problems.append(f"{name}:{n}: a command in an indented code block; fence it (```bash)")
        for n, lang, body, marker in blocks(text):
            if lang in SHELL_LANGS and commands(body):
                problems += [f"{name}:{n}: {p}" for p in marker_problems(marker, root)]
    return problems


def marked_commands(test_name: str):
    """(file, line, command) of every command in the blocks whose marker names the test."""
    out = []
    for path in doc_files():
        for n, lang, body, marker in blocks(path.read_text()):
            if marker and f"{THIS}::{test_name}" in marker.split():
                out += [(path.name, n, c) for c in commands(body)]
    return out


# ---- the runnable snippets --------------------------------------------------------------
def test_every_runnable_snippet_names_a_test_that_exists_or_why_it_is_not_run():
    problems = snippet_problems()
    assert not problems, "\n".join(problems)
    runnable = [b for p in doc_files() for b in blocks(p.read_text())
                if b[1] in SHELL_LANGS and commands(b[2])]
    assert len(runnable) >= 30            # the check saw the docs' blocks, not an empty list


def test_the_snippet_check_finds_what_is_wrong(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_real.py").write_text("def test_here():\n    pass\n")
    (tmp_path / "README.md").write_text(
        "<!-- tested: tests/test_real.py::test_here -->\n```bash\nrlctl train\n```\n"
        "```bash\nrlctl eval\n```\n"                                            # no marker
        "<!-- tested: tests/test_real.py::test_gone -->\n```sh\nrlctl inspect x\n```\n"
        "<!-- tested:\n  tests/test_nope.py::test_x\n-->\n```\nOMP_NUM_THREADS=1 python b.py\n```\n"
        "<!-- not run: -->\n```console\n$ scripts/test\n```\n"
        "```text\nrlctl is only text here\n```\n```python\nimport rlctl\n```\n"
        "\n    rlctl train algo=ppo\n")
    (tmp_path / "docs" / "page.md").write_text(
        "<!-- not run: needs a GPU cluster -->\n```bash\nsrun rlctl train \\\n  x=1\n```\n")
    problems = snippet_problems(tmp_path)
    want = ["README.md:5: no <!-- tested", "README.md:9: tests/test_real.py has no def test_gone(",
            "README.md:15: tests/test_nope.py does not exist", "README.md:19: 'not run' needs a reason",
            "README.md:29: a command in an indented code block"]
    assert len(problems) == len(want), "\n".join(problems)
    for p, w in zip(sorted(problems, key=lambda s: int(s.split(":")[1])), want):
        assert p.startswith(w), (p, w)


def test_cheap_snippets_run(tmp_path, monkeypatch):
    from rlctl.cli import app

    cmds = marked_commands("test_cheap_snippets_run")
    argvs = {" ".join(shlex.split(c, comments=True)) for _, _, c in cmds}
    assert argvs >= {"rlctl --help", "rlctl train --help", "rlctl recipes"}, cmds
    monkeypatch.chdir(tmp_path)
    ran = set()
    for name, line, cmd in cmds:
        argv = shlex.split(cmd, comments=True)
        assert argv[0] == "rlctl", f"{name}:{line}: only rlctl commands run in process: {cmd}"
        if tuple(argv) in ran:
            continue
        ran.add(tuple(argv))
        res = CliRunner().invoke(app, argv[1:])
        out = res.output
        assert res.exit_code == 0 and out.strip(), f"{name}:{line}: {cmd}\n{out}"
        assert "Traceback" not in out, f"{name}:{line}: {cmd}\n{out}"
    assert len(ran) >= 3 and not any(tmp_path.iterdir())     # help and dry runs write nothing


def _fenced(path: Path, first_line: str, lang: str):
    (body,) = [b for _, lg, b, _ in blocks(path.read_text()) if lg == lang and b and
               b[0].startswith(first_line)]
    return body


def test_extending_example_trains(tmp_path, monkeypatch):
    """docs/extending.md's mylosses.py, run by its command (plus settings that shrink the
    run): the three user functions are the ones called."""
    from rlctl.cli import app
    from rlctl.sinks.jsonl import read_jsonl

    page = ROOT / "docs" / "extending.md"
    module = "\n".join(_fenced(page, "# mylosses.py", "python"))
    counting = ("\nCALLS = {}\n\n\ndef _counted(fn):\n    def call(*args, **kwargs):\n"
                "        CALLS[fn.__name__] = CALLS.get(fn.__name__, 0) + 1\n"
                "        return fn(*args, **kwargs)\n    return call\n\n\n"
                "scaled_ppo, my_adv, my_k = map(_counted, (scaled_ppo, my_adv, my_k))\n")
    (tmp_path / "mylosses.py").write_text(module + counting)
    (cmd,) = [c for _, _, c in marked_commands("test_extending_example_trains")]
    argv = shlex.split(cmd, comments=True)
    small = ["trainer.steps=2", "trainer.eval_every=0", "trainer.prompts_per_step=2",
             "algo.group_size=4", "rollout.max_new_tokens=6", "logger=jsonl",
             "logger.console=false", "run.save_model=false", f"run.output_dir={tmp_path / 'runs'}"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        res = CliRunner().invoke(app, argv[1:] + small)
        assert res.exit_code == 0, res.output
        calls = sys.modules["mylosses"].CALLS
    finally:
        sys.modules.pop("mylosses", None)
    assert set(calls) == {"scaled_ppo", "my_adv", "my_k"} and min(calls.values()) >= 2, calls
    (run,) = (tmp_path / "runs").iterdir()
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if "policy/loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["policy/loss"]) for r in steps)
    assert all(r["policy/kl_ref"] >= 0 for r in steps)     # my_k is a square


# ---- README -----------------------------------------------------------------------------
def test_readme_fits_a_few_screens():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES}"


def _table(path: Path):
    lines = path.read_text().splitlines()
    start = lines.index("| group | options | notes |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start:end]


def test_the_configuration_table_is_the_same_in_readme_and_docs():
    readme = _table(ROOT / "README.md")
    assert len(readme) == 7                                  # header, rule, five groups
    assert readme == _table(ROOT / "docs" / "configuration.md")


# ---- the MkDocs site --------------------------------------------------------------------
def mkdocs_build(config: Path, site: Path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(site)], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    return mkdocs_build(ROOT / "mkdocs.yml", out), out


def test_mkdocs_build_strict_passes(site):
    proc, out = site
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in (ROOT / "docs").glob("*.md"):
        assert (out / f"{page.stem}.html").is_file(), page.name
    for png in (ROOT / "docs").glob("*.png"):                # images are copied and shown
        assert (out / png.name).read_bytes() == png.read_bytes()
        assert any(f'src="{png.name}"' in p.read_text() for p in out.glob("*.html")), png.name


def test_readme_links_reach_a_built_page_and_anchor(site):
    proc, out = site
    assert proc.returncode == 0, proc.stdout + proc.stderr
    links = re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text())
    local = [t for t in links if not re.match(r"[a-z]+://", t)]
    assert len(local) >= 15
    for target in local:
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), target
        if path.startswith("docs/") and path.endswith(".md"):
            html = (out / (Path(path).stem + ".html")).read_text()
            assert not anchor or f'id="{anchor}"' in html, target


def _tiny_site(tmp_path: Path, pages: dict, nav: list) -> Path:
    """The repository's mkdocs.yml with its own docs folder and nav."""
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir()
    for name, text in pages.items():
        (tmp_path / "docs" / name).write_text(text)
    cfg.update(docs_dir=str(tmp_path / "docs"), nav=nav)
    cfg.pop("extra_javascript", None)
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


GOOD = {"index.md": "# Home\n\n[the other page](other.md#a-heading)\n",
        "other.md": "# Other\n\n## A heading\n"}


NAV = [{"Home": "index.md"}, {"Other": "other.md"}]


def test_a_tiny_site_with_the_repositorys_settings_builds(tmp_path):
    """The control for the next test: without the planted fault the same site builds."""
    good = mkdocs_build(_tiny_site(tmp_path, GOOD, NAV), tmp_path / "site")
    assert good.returncode == 0, good.stdout + good.stderr


@pytest.mark.parametrize("change, named", [
    ({"index.md": "# Home\n\n[the other page](missing.md)\n"}, "missing.md"),
    ({"index.md": "# Home\n\n[the other page](other.md#no-such-heading)\n"}, "no-such-heading"),
    ({"index.md": "# Home\n\n![a figure](missing.png)\n"}, "missing.png"),
    ({"extra.md": "# Not in the nav\n"}, "extra.md"),
])
def test_strict_build_fails_on_a_broken_link_anchor_image_or_nav(tmp_path, change, named):
    bad = mkdocs_build(_tiny_site(tmp_path, {**GOOD, **change}, NAV), tmp_path / "site")
    assert bad.returncode != 0 and named in bad.stdout + bad.stderr, bad.stdout + bad.stderr


def test_the_nav_lists_every_page():
    nav = json.dumps(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f'"{p.name}"' not in nav]
    assert not missing, missing
