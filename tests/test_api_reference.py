"""The API reference (docs/reference.md, rendered by mkdocstrings: mkdocs.yml) has an entry for
every public name, and each entry names something the source defines. Read from the files alone:
neither the docs tool nor torchrec is needed.

- Public names: ``embcore.__all__`` and ``embcore.torchrec.__all__``.
- An entry is a line ``::: dotted.path`` (mkdocstrings' syntax); it must resolve, through the
  package's ``from .x import y`` re-exports, to a class, function or assignment in a module of
  embcore/, so that a moved or renamed name fails here as well as in ``mkdocs build --strict``.
- Every page under docs/ is in mkdocs.yml's nav, and every page the nav names exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "embcore"
REFERENCE = ROOT / "docs" / "reference.md"
PUBLIC_MODULES = {"embcore": PKG / "__init__.py", "embcore.torchrec": PKG / "torchrec.py"}
ENTRY = re.compile(r"^:::[ \t]+([\w.]+)[ \t]*$", re.MULTILINE)


def declared_all(path: Path) -> list[str]:
    """The names of a module's ``__all__ = [...]`` (a literal list)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__all__"):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path.relative_to(ROOT)} has no literal __all__")


def public_names(modules: dict[str, Path] = PUBLIC_MODULES) -> set[str]:
    return {f"{module}.{name}" for module, path in modules.items() for name in declared_all(path)}


def entries(text: str) -> set[str]:
    return set(ENTRY.findall(text))


def missing_entries(public: set[str], text: str) -> list[str]:
    return sorted(public - entries(text))


def _module_file(dotted: str, pkg: Path) -> Path | None:
    parts = dotted.split(".")[1:]  # under embcore/
    base = pkg.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def _module_name(path: Path, pkg: Path) -> str:
    rel = path.relative_to(pkg).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([pkg.name, *parts])


def _body_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):
            out.update({(a.asname or a.name): node for a in node.names})
    return out


def resolves(dotted: str, pkg: Path = PKG, depth: int = 0) -> bool:
    """Whether ``dotted`` (``embcore[.module...].Name[.member]``) is defined in the source."""
    if depth > 10 or not dotted.startswith(pkg.name + "."):
        return False
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
        path = _module_file(".".join(parts[:cut]), pkg)
        if path is not None:
            break
    else:
        return False
    rest = parts[cut:]
    if not rest:
        return True
    node = _body_names(ast.parse(path.read_text(), str(path)).body).get(rest[0])
    if isinstance(node, ast.ImportFrom):
        alias = next(a for a in node.names if (a.asname or a.name) == rest[0])
        if node.level == 0:
            source = node.module or ""
        else:
            here = _module_name(path, pkg).split(".")
            if path.name != "__init__.py":
                here = here[:-1]
            here = here[:len(here) - (node.level - 1)]
            source = ".".join(here + ([node.module] if node.module else []))
        return resolves(".".join([source, alias.name, *rest[1:]]), pkg, depth + 1)
    if node is None:
        return False
    for member in rest[1:]:  # Class.method
        if not isinstance(node, ast.ClassDef):
            return False
        found = _body_names(node.body).get(member)
        if found is None:
            return False
        node = found
    return True


# ------------------------------------------------------------------------------ the checkers


def _fake_package(root: Path) -> Path:
    files = {
        "pkg/__init__.py": "from .inner.mod import Thing, helper as renamed\nalias = renamed\n"
                           "__all__ = ['Thing', 'renamed', 'alias', 'gone']\n",
        "pkg/inner/__init__.py": "",
        "pkg/inner/mod.py": "class Thing:\n    def method(self):\n        pass\n\n"
                            "def helper():\n    pass\n",
        "pkg/extra.py": "__all__ = ['Extra']\nclass Extra:\n    pass\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "pkg"


def test_the_checker_finds_missing_entries(tmp_path):
    pkg = _fake_package(tmp_path)
    public = public_names({"pkg": pkg / "__init__.py", "pkg.extra": pkg / "extra.py"})
    assert public == {"pkg.Thing", "pkg.renamed", "pkg.alias", "pkg.gone", "pkg.extra.Extra"}
    text = "# Reference\n\n::: pkg.Thing\n\n::: pkg.alias\n::: pkg.extra.Extra\n`::: pkg.gone`\n"
    assert missing_entries(public, text) == ["pkg.gone", "pkg.renamed"]


def test_the_resolver_follows_re_exports(tmp_path):
    pkg = _fake_package(tmp_path)
    for good in ("pkg.Thing", "pkg.Thing.method", "pkg.renamed", "pkg.alias", "pkg.extra.Extra",
                 "pkg.inner.mod.helper", "pkg.inner"):
        assert resolves(good, pkg), good
    for bad in ("pkg.gone", "pkg.Thing.nothing", "pkg.renamed.method", "pkg.inner.nothing",
                "other.Thing", "pkg.extra.Extra.x"):
        assert not resolves(bad, pkg), bad


# ------------------------------------------------------------------------------- the reference


def test_every_public_name_has_a_reference_entry():
    missing = missing_entries(public_names(), REFERENCE.read_text())
    assert not missing, ("public names without an entry in docs/reference.md (add a line "
                         "'::: <name>' in its section):\n" + "\n".join(missing))


def test_every_reference_entry_is_defined_in_the_source():
    broken = sorted(e for e in entries(REFERENCE.read_text()) if not resolves(e))
    assert not broken, ("docs/reference.md names what the source does not define (moved or "
                        "renamed?):\n" + "\n".join(broken))


def test_every_docs_page_is_in_the_nav():
    nav = re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$",
                     (ROOT / "mkdocs.yml").read_text(), flags=re.MULTILINE)
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert set(nav) == pages, (f"in docs/ but not in mkdocs.yml's nav: {sorted(pages - set(nav))}; "
                               f"in the nav but not in docs/: {sorted(set(nav) - pages)}")
