"""The package's folders are its layers, and imports run only downward (docs/architecture.md).

Every import inside ``embcore`` (at the top of a module or inside a function) is read from the
source. A module may import modules of its own folder (without a cycle) and of lower layers;
an import of a higher layer, or of a layer beside its own, fails here naming both files.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "embcore"

# Bottom to top; folders in one tuple stand side by side and may not import each other. The
# package's own top-level modules (the shell: engine, layer, checkpoint) stand above them all.
LAYERS: list[tuple[str, ...]] = [
    ("base",),       # torch's private APIs, collectives, nested structures, the version
    ("formats",),    # the on-disk formats: checkpoint and publish directories, file steps
    ("config",),     # what users declare: tables, features, optimizers, the spec
    ("numerics",),   # the bit-exact rules every kernel follows: hashes, 16-bit rounding
    ("kernels",),    # the kernels' bindings: fused CPU kernels (ctypes), Triton kernels
    ("ops",),        # tensor math over the kernels: bags, combine, the update; its oracles
    ("inputs",),     # a user's batch -> one Bags per feature
    ("planning",),   # where every table lives
    ("state",),      # this process's rows and slots
    ("step", "serving"),  # the three verbs of a step; serving's plain lookups
    ("",),           # the shell: engine.py, layer.py, checkpoint.py (and __init__, __main__)
]
RANK = {folder: i for i, group in enumerate(LAYERS) for folder in group}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _folder(module: str) -> str:
    """``embcore.step.lookup`` -> ``step``; the shell's modules (and the package) -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and module in _packages()) else ""


def _packages() -> set[str]:
    return {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _imports(module: str) -> set[str]:
    """The embcore modules ``module`` imports (a ``from package import name`` counts as the
    submodule ``name`` when there is one, else as the package)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "embcore"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "embcore":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in MODULES else target)
    out.discard(module)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def test_every_folder_is_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(RANK) - {""}, (
        f"folders {sorted(folders ^ (set(RANK) - {''}))} are not in LAYERS (or are gone): "
        f"give each folder its place in tests/test_layers.py and docs/architecture.md")


def _violations(module: str, imports: set[str]) -> list[str]:
    """The imports of ``module`` that run up or sideways, as readable paths."""
    here = _folder(module)
    wrong = []
    for target in sorted(imports):
        there = _folder(target)
        if target == "embcore" or (there != here and RANK[there] >= RANK[here]):
            wrong.append(f"{MODULES[target].relative_to(PACKAGE.parent)} "
                         f"(layer {there or 'shell'!r})")
    return wrong


@pytest.mark.parametrize("module", sorted(set(MODULES) - {"embcore"}))  # (the face hands on)
def test_imports_run_only_downward(module):
    wrong = _violations(module, GRAPH[module])
    assert not wrong, (f"{MODULES[module].relative_to(PACKAGE.parent)} (layer "
                       f"{_folder(module) or 'shell'!r}) imports upward or sideways: {wrong}")


def test_the_checker_reports_upward_and_sideways_imports():
    plan = "embcore.planning.plan"
    assert _violations(plan, GRAPH[plan] | {"embcore.state.store"}) == [
        "embcore/state/store.py (layer 'state')"]
    lookup = "embcore.step.lookup"
    assert _violations(lookup, GRAPH[lookup] | {"embcore.serving.serve"}) == [
        "embcore/serving/serve.py (layer 'serving')"]
    assert _violations(lookup, GRAPH[lookup] | {"embcore.engine"}) == [
        "embcore/engine.py (layer 'shell')"]


def test_no_import_cycles():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if t == "embcore" and m != "embcore":
                continue  # (reported by test_imports_run_only_downward)
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)
