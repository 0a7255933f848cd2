"""Structural claims of docs/architecture.md, checked on the source (issue 41, point 5).

- A kind of table is decided once (state/build.py): neither the step's modules (step/) nor
  online.py read a store's kind (``.dynamic``, ``.tables``, ``.slots`` of a store),
  or a private attribute of the engine (``engine._...``); step/ reads a rows object's kind
  (``.maps``) or a physical table's (``.dynamic``) nowhere: where the protocol differs it asks
  the rows object a verb (``Rows.may_refuse``: a training resolve may refuse a batch).
- The backend is chosen once (ops/backend.py ``choose``): by the engine (for the plan) and the
  store (and for tables served as tensors, serving/serve.py), nowhere in step/.
- A batch's route is chosen in one place: only step/path.py calls the native preprocess.
- Only state/build.py constructs rows objects (their kind is chosen there).
- No module of the package is over ``MAX_LINES`` lines (issue 53, point 3).
- The shell's file steps are written once, in formats/files.py (issue 53, point 6): fsync,
  CRC-32 and ``flock`` are called nowhere else, and ``zlib`` / ``fcntl`` imported nowhere else.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "embcore"
STEP_AND_ONLINE = sorted((PACKAGE / "step").glob("*.py")) + [PACKAGE / "online.py"]
KIND_ATTRIBUTES = {"dynamic", "tables", "slots"}  # (a rows object's .maps: KIND_READS)
ROWS_KINDS = {"MemoryRows", "OffloadedRows", "MappedRows"}


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def _store_like(node: ast.AST) -> bool:
    """``store``, ``self.store``, ``x.store``, ``self._store``: a name for a RowStore."""
    if isinstance(node, ast.Name):
        return node.id in ("store", "_store")
    return isinstance(node, ast.Attribute) and node.attr in ("store", "_store")


def test_step_and_online_read_no_store_kind_and_no_engine_private():
    found = []
    for path in STEP_AND_ONLINE:
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.Attribute):
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            if node.attr in KIND_ATTRIBUTES and _store_like(node.value):
                found.append(f"{where}: store.{node.attr}")
            if (node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id == "engine"):
                found.append(f"{where}: engine.{node.attr}")
    assert not found, "reads of a store's kind or an engine private:\n" + "\n".join(found)


def test_the_checks_see_what_they_forbid():
    """The checks above find such reads when they are there (the test can fail)."""
    tree = ast.parse("store.tables\nself.store.dynamic\nengine._quiet()\n")
    kinds = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and n.attr in KIND_ATTRIBUTES and _store_like(n.value)]
    privates = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and n.attr.startswith("_") and isinstance(n.value, ast.Name)
                and n.value.id == "engine"]
    assert len(kinds) == 2 and len(privates) == 1


def _calls(attr: str) -> dict[str, int]:
    """Per module of the package, how many calls of ``<something>.<attr>(...)`` it makes."""
    out: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        n = sum(1 for node in ast.walk(_tree(path)) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and node.func.attr == attr
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "native")
        if n:
            out[str(path.relative_to(PACKAGE))] = n
    return out


def test_the_route_of_a_batch_is_chosen_in_one_place():
    assert set(_calls("prepare")) == {"step/path.py"}


def test_only_the_builder_chooses_a_kind():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ROWS_KINDS):
                found.append(str(path.relative_to(PACKAGE)))
    assert set(found) == {"state/build.py"}, found


# The reads of a table's kind left in step/ (a rows object's ``.maps``, a physical table's
# ``.dynamic``), by module: none (each a verb of the rows object or the plan instead).
KIND_READS: dict[str, int] = {}


def _kind_reads() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted((PACKAGE / "step").glob("*.py")):
        n = sum(1 for node in ast.walk(_tree(path)) if isinstance(node, ast.Attribute)
                and node.attr in ("maps", "dynamic") and isinstance(node.ctx, ast.Load))
        if n:
            out[str(path.relative_to(PACKAGE))] = n
    return out


def test_step_reads_a_tables_kind_no_more_than_it_did():
    got = _kind_reads()
    worse = {k: (n, KIND_READS.get(k, 0)) for k, n in got.items() if n > KIND_READS.get(k, 0)}
    assert not worse, f"new reads of a table's kind in step/ (now, allowed): {worse}"


def test_the_backend_is_chosen_by_the_engine_and_the_store_only():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id == "choose":
                found.append(str(path.relative_to(PACKAGE)))
    assert set(found) <= {"engine.py", "state/store.py", "ops/combine.py", "ops/update.py",
                          "serving/serve.py"}, found
    assert not [f for f in found if f.startswith("step/")]


# Where the code outside kernels/ asks whether kernels apply (``cpu.usable`` / ``available`` /
# ``enabled``, ``gpu.usable`` / ``available``): ops/backend.py, which chooses the backend, and
# the fused CPU backend's raw-id map, whose layout also serves torch ops for a call a tracer sees
# or after ``cpu.set_enabled(False)`` (state/vocab/native_map.py, one place). Issue 53 found 38.
BACKEND_CHECKS = {"ops/backend.py": 4, "state/vocab/native_map.py": 1}


def _backend_checks() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if rel.startswith("kernels/"):
            continue
        n = sum(1 for node in ast.walk(_tree(path))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("usable", "available", "enabled")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("cpu", "gpu", "native"))
        if n:
            out[rel] = n
    return out


def test_the_backend_is_asked_not_checked_per_call():
    assert _backend_checks() == BACKEND_CHECKS


MAX_LINES = 700


def test_no_module_is_over_the_line_limit():
    over = {str(p.relative_to(PACKAGE)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (cut each along a seam): {over}"


# The file steps formats/files.py writes once: ``module.function`` calls, and modules imported.
FILE_STEPS = {("os", "fsync"), ("os", "fdatasync"), ("zlib", "crc32"), ("fcntl", "flock"),
              ("fcntl", "lockf")}
FILE_MODULES = {"zlib", "fcntl"}


def _file_steps(tree: ast.AST) -> list[str]:
    """The calls of ``FILE_STEPS`` (``os.fsync(...)``, ``from os import fsync``) and the imports of
    ``FILE_MODULES`` (``import zlib``, ``importlib.import_module("fcntl")``) in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) \
                and (node.func.value.id, node.func.attr) in FILE_STEPS:
            found.append(f"{node.lineno}: {node.func.value.id}.{node.func.attr}")
        elif isinstance(node, ast.Call) and any(
                isinstance(a, ast.Constant) and a.value in FILE_MODULES for a in node.args) \
                and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module":
            found.append(f"{node.lineno}: import_module")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name in FILE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module in FILE_MODULES or any(
                (node.module, a.name) in FILE_STEPS for a in node.names)):
            found.append(f"{node.lineno}: from {node.module} import")
    return found


def test_durable_writes_checksums_and_locks_are_written_once():
    found = {str(p.relative_to(PACKAGE)): got for p in sorted(PACKAGE.rglob("*.py"))
             if (got := _file_steps(_tree(p)))}
    assert set(found) == {"formats/files.py"}, (
        f"fsync, CRC-32 or flock outside formats/files.py (use its helpers): {found}")


def test_the_file_step_check_sees_what_it_forbids():
    tree = ast.parse("import zlib\nfrom os import fsync\nos.fsync(f.fileno())\n"
                     "fcntl.flock(fd, 2)\nimportlib.import_module('fcntl')\nzlib.crc32(b)\n")
    assert len(_file_steps(tree)) == 6
