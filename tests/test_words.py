"""Words that drift: the package and the benchmarks cite no internal documents or issue numbers,
and the documentation's references to files (and to the names defined in them) resolve.

- Code and benchmarks say the thing, or cite docs/semantics.md's sections (which users have),
  never "DESIGN n", "DESIGN.md" or "issue n".
- docs/architecture.md: every ``file.py`` it names exists (paths relative to embcore/, or to the
  repository for tests/, docs/, benchmarks/, examples/), and every ``path/file.py Name`` of its
  step diagram and nouns table names a class, function or ``Class.method`` defined in that file;
  the files of its tree table lie in the row's folder.
- README.md and docs/**/*.md (the guide too): every repository path in backticks exists.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "embcore"
REPO_DIRS = ("embcore/", "tests/", "docs/", "benchmarks/", "examples/")


# ----------------------------------------------------------------------------- citations
CITATION = re.compile(r"\bDESIGN(?:\.md\b|\s+(?:section\s+)?§?\s*\d)|\bissues?\s*#?\s*\d+",
                      re.IGNORECASE)
CITATION_FILES = ("embcore/**/*.py", "embcore/kernels/cpu/csrc/*", "benchmarks/**/*.py", "benchmarks/*.md",
                  "benchmarks/**/*.md")


def test_the_citation_pattern():
    for cited in ("see DESIGN 2.3", "DESIGN 5's rule", "(DESIGN.md)", "design.md section 4",
                  "issue 12", "Issue #7", "issues 3 and 4", "(issue 40)"):
        assert CITATION.search(cited), cited
    for plain in ("issued 2 collectives", "the design of the store", "an issue: the cache",
                  "docs/semantics.md section 3", "DESIGNATED 2"):
        assert not CITATION.search(plain), plain


def test_no_citations_of_internal_documents_or_issues():
    files = sorted({p for pattern in CITATION_FILES for p in ROOT.glob(pattern) if p.is_file()})
    assert any(p.name == "compat.py" for p in files) and any(p.suffix == ".h" for p in files)
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in files
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if CITATION.search(line)]
    assert not hits, ("citations of DESIGN / issues that users cannot read; cite docs/semantics.md's "
                      "sections or say the thing:\n" + "\n".join(hits))


# ------------------------------------------------------------------- docs/architecture.md
FILE = r"(?:[\w-]+/)*[\w-]+\.(?:py|cpp|h|c)"
NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?"
FILE_REF = re.compile(rf"(?<![\w./-])({FILE})(?![\w/])")
FILE_AND_NAME = re.compile(rf"(?<![\w./-])({FILE})[ \t]+({NAME})(?!\w|\.\w)")


def _resolve(ref: str) -> tuple[Path | None, str]:
    """The file ``ref`` names (relative to embcore/, or to the repository for tests/, docs/...;
    a bare file name: the one file of that name under embcore/), or None and why not."""
    if ref.startswith(REPO_DIRS):
        path = ROOT / ref
        return (path, "") if path.is_file() else (None, "no such file")
    if "/" in ref:
        path = PKG / ref
        return (path, "") if path.is_file() else (None, "no such file under embcore/")
    if (PKG / ref).is_file():
        return PKG / ref, ""
    found = sorted(p for p in PKG.rglob(ref) if p.is_file())
    if len(found) == 1:
        return found[0], ""
    if not found:
        return None, "no such file under embcore/"
    return None, f"ambiguous: {[str(p.relative_to(PKG)) for p in found]}; give its folder"


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body defines (functions, classes, assignments; inside if / try)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "handlers", []),
                          getattr(node, "finalbody", [])):
                for part in block:
                    out.update(_definitions(part.body if isinstance(part, ast.ExceptHandler)
                                            else [part]))
    return out


@functools.cache
def _module_definitions(path: Path) -> dict[str, ast.AST]:
    return _definitions(ast.parse(path.read_text(), str(path)).body)


def _defines(path: Path, name: str) -> bool:
    """Whether ``path`` defines ``name`` (``Class``, ``function`` or ``Class.method``)."""
    if path.suffix != ".py":  # a C++ source: the word appears
        return re.search(rf"\b{re.escape(name.rsplit('.', 1)[-1])}\b", path.read_text()) is not None
    head, _, attr = name.partition(".")
    node = _module_definitions(path).get(head)
    if node is None or not attr:
        return node is not None
    return isinstance(node, ast.ClassDef) and attr in _definitions(node.body)


def _check(ref: str, names: list[str], where: str, problems: list[str]) -> None:
    path, why = _resolve(ref)
    if path is None:
        problems.append(f"{where}: {ref}: {why}")
        return
    for name in names:
        if not _defines(path, name):
            problems.append(f"{where}: {ref} {name}: {name!r} is not defined in "
                            f"{path.relative_to(ROOT)}")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def architecture_problems(text: str, doc: str = "docs/architecture.md") -> list[str]:
    """Every broken file reference of an architecture document, as ``doc:line: ref: why``."""
    problems: list[str] = []
    in_fence, header = False, None  # header: the current table's header cells (lower case)
    for i, line in enumerate(text.splitlines(), 1):
        where = f"{doc}:{i}"
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if not in_fence and line.lstrip().startswith("|"):
            cells = _cells(line)
            if header is None:
                header = [c.lower() for c in cells]
                continue
            if all(set(c) <= set("-: ") for c in cells):  # the separator row
                continue
            row = dict(zip(header, cells))
            if "noun" in header and "file" in header:  # | noun | file | what it is |
                nouns = [n.strip().strip("`") for n in row.get("noun", "").split(",")]
                refs = FILE_REF.findall(row.get("file", "").replace("`", ""))
                if not refs:
                    problems.append(f"{where}: the nouns table's row {cells[0]!r} names no file")
                names = [n for n in nouns if re.fullmatch(NAME, n)]
                if len(refs) == 1:
                    _check(refs[0], names, where, problems)
                else:  # several files: each must exist, each name be defined in one of them
                    for ref in refs:
                        _check(ref, [], where, problems)
                    paths = [p for p in (_resolve(r)[0] for r in refs) if p is not None]
                    problems += [f"{where}: {name!r} is not defined in any of {refs}"
                                 for name in names if paths
                                 and not any(_defines(p, name) for p in paths)]
                continue
            if "folder" in header:  # | layer | folder | what it holds |: files in the folders
                folder_cell = row["folder"]
                folders = [f for f in _ticked(folder_cell) if f.endswith("/")] or [""]
                rest = " ".join(c for k, c in row.items() if k != "folder")
                for ref in _ticked(rest):
                    if not re.fullmatch(rf"{FILE}|[\w-]+/", ref):
                        continue
                    if not any((PKG / f / ref).exists() for f in folders):
                        problems.append(f"{where}: {ref}: not in {folders} (under embcore/)")
                continue
        else:
            header = None
        code = in_fence or line.startswith(("    ", "\t"))
        named = {m.start(1): m for m in FILE_AND_NAME.finditer(line)} if code else {}
        for m in FILE_REF.finditer(line):
            if m.start(1) in named:
                _check(m.group(1), [named[m.start(1)].group(2)], where, problems)
            else:
                _check(m.group(1), [], where, problems)
    return problems


def _fake_tree(root: Path) -> None:
    """A small repository: embcore/{engine.py, base/comm.py, state/store.py, kernels/csrc/pool.h},
    tests/test_x.py."""
    files = {
        "embcore/engine.py": "class Embedding:\n    def enqueue(self):\n        pass\n",
        "embcore/base/comm.py": "class Communicator:\n    rank: int\n\n"
                                "try:\n    import numpy\nexcept ImportError:\n"
                                "    def fallback():\n        pass\n",
        "embcore/state/store.py": "class RowStore:\n    def combine(self):\n        pass\n\n"
                                  "def lookup():\n    pass\n\nLIMIT = 3\n",
        "embcore/kernels/csrc/pool.h": "struct Pool {};\n",
        "embcore/ops/store.py": "",  # a second store.py: a bare "store.py" is ambiguous
        "tests/test_x.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_architecture_checker_finds_broken_references(tmp_path, monkeypatch):
    _fake_tree(tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path / "embcore")
    text = "\n".join([
        "Prose names base/comm.py and engine.py (fine), shards.py and tests/test_nothing.py (not),",
        "tests/test_x.py (fine) and store.py (ambiguous).",
        "",
        "| noun | file | what it is |",
        "|---|---|---|",
        "| RowStore, lookup, LIMIT | state/store.py | fine |",
        "| Gone, Communicator, fallback | base/comm.py | Gone is not defined |",
        "| the kernels' thread pool | kernels/csrc/pool.h | no identifier: the file only |",
        "| Pool | kernels/csrc/pool.h | a word of the file |",
        "",
        "| layer | folder | what it holds |",
        "|---|---|---|",
        "| 1 | `base/` | (`comm.py`), (`shards.py`) |",
        "| 8 | the shell | `engine.py`, `layer.py` |",
        "",
        "```text",
        "   |  Embedding.enqueue ........ engine.py",
        "     state/store.py     RowStore.combine",
        "     state/store.py lookup      (engine.py Embedding.nothing)",
        "     engine.py RowStore.combine",
        "     base/comm.py Communicator.rank",
        "```",
    ])
    got = architecture_problems(text, "doc")
    assert got == [
        "doc:1: shards.py: no such file under embcore/",
        "doc:1: tests/test_nothing.py: no such file",
        "doc:2: store.py: ambiguous: ['ops/store.py', 'state/store.py']; give its folder",
        "doc:7: base/comm.py Gone: 'Gone' is not defined in embcore/base/comm.py",
        "doc:13: shards.py: not in ['base/'] (under embcore/)",
        "doc:14: layer.py: not in [''] (under embcore/)",
        ("doc:19: engine.py Embedding.nothing: 'Embedding.nothing' is not defined in "
         "embcore/engine.py"),
        ("doc:20: engine.py RowStore.combine: 'RowStore.combine' is not defined in "
         "embcore/engine.py"),
    ], got


def test_architecture_references_resolve():
    problems = architecture_problems((ROOT / "docs/architecture.md").read_text())
    assert not problems, ("docs/architecture.md names files or definitions that do not exist:\n"
                          + "\n".join(problems))


# ------------------------------------------------------------------- paths in the docs
REPO_PATH = re.compile(r"(?<![\w./-])(?:embcore|tests|docs|benchmarks|examples)/[\w./*-]*")


def path_problems(text: str, doc: str) -> list[str]:
    """Every repository path in backticks (inline or fenced) of a document that does not exist."""
    problems = []
    in_fence = False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        spans = [line] if in_fence else re.findall(r"`([^`]+)`", line)
        for span in spans:
            for ref in REPO_PATH.findall(span):
                ref = ref.rstrip(".:")
                if "*" in ref:
                    ok = any(ROOT.glob(ref))
                else:
                    ok = (ROOT / ref).exists()
                if not ok:
                    problems.append(f"{doc}:{i}: {ref}")
    return problems


def test_the_path_checker_finds_missing_paths(tmp_path, monkeypatch):
    _fake_tree(tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    text = ("`embcore/base/comm.py`, `embcore/*/store.py` and `tests/` exist (`tests/test_x.py`:\n"
            "`embcore/shards.py`, `docs/nothing.md` do not; examples/s is prose, `embcore/x*.py`\n"
            "```bash\npython tests/test_x.py --data examples/none/train.py\n```\n")
    assert path_problems(text, "doc") == ["doc:2: embcore/shards.py", "doc:2: docs/nothing.md",
                                          "doc:2: embcore/x*.py", "doc:4: examples/none/train.py"]


def test_paths_in_the_docs_exist():
    problems = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        problems += path_problems(doc.read_text(), str(doc.relative_to(ROOT)))
    assert not problems, "paths in backticks that do not exist:\n" + "\n".join(problems)


# ------------------------------------------------- file names in the README and the code's comments
def comment_problems(text: str, doc: str, c_comments: bool) -> list[str]:
    """Every file a document names that does not exist: in backticks (README), or anywhere in a
    C source's ``//`` comments (``c_comments``), resolved as docs/architecture.md's are."""
    problems: list[str] = []
    for i, line in enumerate(text.splitlines(), 1):
        if c_comments:
            spans = [line.split("//", 1)[1]] if "//" in line else []
        else:
            spans = re.findall(r"`([^`]+)`", line)
        for span in spans:
            for m in FILE_REF.finditer(span):
                ref = m.group(1)
                if ref.startswith(("tests/", "docs/", "benchmarks/", "examples/")):
                    continue  # (test_paths_in_the_docs_exist checks repository paths)
                _check(ref, [], f"{doc}:{i}", problems)
    return problems


def test_the_comment_checker_finds_stale_file_names(tmp_path, monkeypatch):
    _fake_tree(tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path / "embcore")
    c = "// base/comm.py checks it (and native.py did)\nint x;  // pool.h\n"
    assert comment_problems(c, "k.h", True) == ["k.h:1: native.py: no such file under embcore/"]
    readme = "`engine.py` and `gone.py`; gone.py outside backticks is prose\n"
    assert comment_problems(readme, "R", False) == ["R:1: gone.py: no such file under embcore/"]


def test_file_names_in_the_readme_and_the_c_comments_exist():
    problems = comment_problems((ROOT / "README.md").read_text(), "README.md", False)
    for source in sorted((PKG / "kernels").rglob("*.[hc]*")):
        if source.suffix in (".h", ".cpp", ".c"):
            problems += comment_problems(source.read_text(), str(source.relative_to(ROOT)), True)
    assert not problems, "file names that do not exist:\n" + "\n".join(problems)
