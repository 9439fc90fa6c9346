"""The house's size rules and its map, kept by tests rather than by a review: no class over 300 lines and no function
over 60 in fully_async/, docs/benchmarks.md a summary plus the current passes under 600 lines with the history beside
it, every top-level module in one import layer and in the README's Layout, and every relative link in the docs
landing on a file and a heading that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fully_async"
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60
MAX_BENCHMARKS_LINES = 600

# Over the rule when the rule came in, each at most its size then: it may shrink, not grow. Delete an entry once its
# code fits (the test below says so). `path::qualified name` -> lines.
KNOWN_OVER: dict[str, int] = {}


def oversized(source: str, path: str = "<source>") -> dict[str, int]:
    """`path::qualified name` -> lines of each class over MAX_CLASS_LINES and each function (methods and nested
    functions too) over MAX_FUNCTION_LINES. A definition's lines run from its `def` / `class` line to its last line,
    docstring and comments inside included, decorators not."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES
                if lines > limit:
                    found[f"{path}::{name}"] = lines
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def size_violations(root: Path, known: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """(what is over the rules beyond its `known` size, the `known` entries that fit now) for root/fully_async."""
    found: dict[str, int] = {}
    for file in sorted((root / "fully_async").rglob("*.py")):
        found.update(oversized(file.read_text(), file.relative_to(root).as_posix()))
    grown = {k: v for k, v in found.items() if v > known.get(k, 0)}
    return grown, sorted(set(known) - set(found))


def test_no_class_over_300_lines_and_no_function_over_60_in_the_package():
    grown, fits = size_violations(ROOT, KNOWN_OVER)
    assert not grown, (
        f"over the size rules (class <= {MAX_CLASS_LINES}, function <= {MAX_FUNCTION_LINES}): split {grown}"
    )
    assert not fits, f"these fit the rules now: delete them from KNOWN_OVER so they stay fitting: {fits}"


def _class_of(lines: int) -> str:
    body = "\n".join(f"    x{i} = {i}" for i in range(lines - 1))
    return f"class Big:\n{body}\n"


def _function_of(lines: int) -> str:
    body = "\n".join(f"        x{i} = {i}" for i in range(lines - 1))
    return f"class Small:\n    def method(self):\n{body}\n"


def test_the_checker_flags_a_301_line_class_and_a_61_line_method_not_one_line_less():
    assert oversized(_class_of(301), "m.py") == {"m.py::Big": 301}
    assert oversized(_class_of(300), "m.py") == {}
    assert oversized(_function_of(61), "m.py") == {"m.py::Small.method": 61}
    assert oversized(_function_of(60), "m.py") == {}
    nested = "def outer():\n    async def inner():\n" + "\n".join(f"        y{i} = {i}" for i in range(60)) + "\n"
    assert oversized(nested, "m.py") == {"m.py::outer": 62, "m.py::outer.inner": 61}


def test_the_package_check_reads_every_file_and_holds_a_known_size(tmp_path):
    (tmp_path / "fully_async" / "engines").mkdir(parents=True)
    (tmp_path / "fully_async" / "engines" / "room.py").write_text(_class_of(301))
    (tmp_path / "fully_async" / "hall.py").write_text(_class_of(310))
    known = {"fully_async/hall.py::Big": 310, "fully_async/gone.py::Old": 400}
    assert size_violations(tmp_path, known) == ({"fully_async/engines/room.py::Big": 301}, ["fully_async/gone.py::Old"])
    (tmp_path / "fully_async" / "hall.py").write_text(_class_of(311))
    assert "fully_async/hall.py::Big" in size_violations(tmp_path, known)[0]


def test_benchmarks_md_is_a_summary_and_the_current_passes_with_the_history_beside_it():
    lines = (ROOT / "docs" / "benchmarks.md").read_text().count("\n")
    assert lines < MAX_BENCHMARKS_LINES, (
        f"docs/benchmarks.md has {lines} lines: move superseded passes and long notes to docs/benchmarks-history.md"
    )
    assert (ROOT / "docs" / "benchmarks-history.md").is_file()


def _layer_modules() -> list[str]:
    # pyproject.toml's [tool.importlinter] layers, read as text: tomllib is Python 3.11+, the project runs on 3.10.
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^layers = \[\n(.*?)^\]", text, re.S | re.M)
    assert block, "pyproject.toml has no importlinter layers list"
    return re.findall(r"fully_async\.(\w+)", "\n".join(ln.split("#")[0] for ln in block.group(1).splitlines()))


def test_every_top_level_module_is_in_exactly_one_import_layer_and_every_named_one_exists():
    named = _layer_modules()
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert sorted(modules - set(named)) == [], "in no import layer (pyproject.toml)"
    assert sorted(set(named) - modules) == [], "named in the import layers but not in the package"
    assert sorted(n for n in set(named) if named.count(n) > 1) == [], "named in two layers"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = heading.strip().replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _outside_code(text: str) -> list[tuple[int, str]]:
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated one gets GitHub's -1, -2 ... suffix."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in _outside_code(text):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            anchor = github_anchor(heading.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def dead_links(doc: Path) -> list[str]:
    """The relative links of a markdown file whose file, or whose anchor in a markdown file, does not exist."""
    dead = []
    for number, line in _outside_code(doc.read_text()):
        for target in _LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                dead.append(f"{doc.name}:{number}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                dead.append(f"{doc.name}:{number}: {target} (no such heading)")
    return dead


def _docs() -> list[Path]:
    """docs/*.md, README.md and the READMEs beside the code (examples, patches, the package's folders)."""
    beside = [p for top in ("examples", "patches", "fully_async", "scripts") for p in (ROOT / top).rglob("*.md")]
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", *sorted(beside)]


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_of_the_docs_lands_on_a_file_and_a_heading(doc):
    assert dead_links(doc) == []


def test_docs_named_in_the_code_exist():
    named = set()
    for top in ("fully_async", "scripts", "tests", "examples", "docs"):
        for file in (ROOT / top).rglob("*"):
            if file.suffix in {".py", ".yaml", ".sh", ".md"} and ".venv" not in file.parts:
                named |= set(re.findall(r"\bdocs/[\w.-]+\.md\b", file.read_text(errors="replace")))
    named |= set(re.findall(r"\bdocs/[\w.-]+\.md\b", (ROOT / "README.md").read_text()))
    assert sorted(n for n in named if not (ROOT / n).is_file()) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Top `x` (issue 1): it's\n\n## Top `x` (issue 1): it's\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#top-x-issue-1-its) [second](a.md#top-x-issue-1-its-1) [self](#here) [web](https://x.org/y)\n"
        "[gone](gone.md) [no heading](a.md#nowhere) `[span](missing.md)`\n```\n[in code](missing.md)\n```\n# Here\n"
    )
    assert dead_links(tmp_path / "b.md") == [
        "b.md:2: gone.md (no such file)",
        "b.md:2: a.md#nowhere (no such heading)",
    ]


def _readme_layout() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Layout\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_the_readmes_layout_names_every_top_level_module_and_every_doc():
    layout = _readme_layout()
    rooms = [p.name for p in PACKAGE.glob("*.py") if p.stem != "__init__"]
    rooms += [f"{p.parent.name}/" for p in PACKAGE.glob("*/__init__.py")]
    assert [r for r in sorted(rooms) if not re.search(rf"(?<![\w/.]){re.escape(r)}(?!\w)", layout)] == []
    docs_line = layout[layout.index("\ndocs/") :]
    assert [d.stem for d in sorted((ROOT / "docs").glob("*.md")) if not re.search(rf"\b{d.stem}\b", docs_line)] == []


def private_imports(source: str) -> list[str]:
    """The `_private` names a module imports from another module of the package (a name used across modules is a
    public one: rename it, or use the public function beside it)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fully_async"):
            names += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and a.name[1] != "_"]
    return names


def test_no_module_of_the_package_imports_a_private_name_of_another():
    found = {
        file.relative_to(ROOT).as_posix(): names
        for file in sorted(PACKAGE.rglob("*.py"))
        if (names := private_imports(file.read_text()))
    }
    assert found == {}
    assert private_imports("from fully_async.multimodal.images import IMAGE_PLACEHOLDER, _png\n") == [
        "fully_async.multimodal.images._png"
    ]
    assert private_imports("from fully_async import __version__\nfrom os import _exit\n") == []
