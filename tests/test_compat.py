"""embcore/base/compat.py: each torch private fast path against its public fallback, and the
torch private names embcore relies on.

Every function is run on random inputs with the private paths switched on and off and must give
the same results (exceptions, documented in compat.py, are checked as such); the guards are
checked to take the fallback where the private path does not apply. The installed torch must lie
in the range compat.py was checked on, every private name it declares must still exist there,
and no other module may use one.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples
from switches import private_paths

from embcore.base import compat


def both(fn, *args):
    """``fn(*args)`` with the private paths on, then off."""
    with private_paths(True):
        on = fn(*args)
    with private_paths(False):
        off = fn(*args)
    return on, off


def test_switch_returns_the_previous_setting():
    assert compat.private_fast_paths()
    assert compat.set_private_fast_paths(False) is True
    assert not compat.private_fast_paths()
    assert compat.set_private_fast_paths(True) is False
    assert compat.private_fast_paths()


# ---------------------------------------------------------------------------------- jagged
def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same values, dtype, shape, strides and memory (a view of the same data)."""
    return (torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


@st.composite
def jagged_tensors(draw):
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=6))
    dtype = draw(st.sampled_from([torch.int32, torch.int64, torch.float32]))
    nnz = sum(lengths)
    pad = draw(st.integers(0, 3))  # values a slice of a larger buffer (a storage offset)
    buf = torch.arange(nnz + 2 * pad).to(dtype) * 3 - 7
    values = buf[pad:pad + nnz]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    holes = None
    if draw(st.booleans()):  # with lengths: bag b is values[offsets[b]:offsets[b] + holes[b]]
        holes = torch.tensor([draw(st.integers(0, n)) for n in lengths])
    return torch.nested.nested_tensor_from_jagged(values, offsets, lengths=holes)


@settings(max_examples=examples(60), deadline=None)
@given(jagged_tensors())
def test_jagged_parts_private_equals_public(x):
    (v1, o1, l1), (v2, o2, l2) = both(compat.jagged_parts, x)
    assert same_tensor(v1, v2) and v1.shape == v2.shape
    assert o1 is o2
    assert l1 is l2  # the same tensor, or both None
    assert v1 is x._values and v2 is not x._values  # each path was taken


def test_jagged_parts_without_the_fields_uses_the_public_methods():
    class Jagged:  # a NestedTensor of another torch: no _values / _offsets
        requires_grad = False

        def values(self):
            return torch.tensor([1, 2])

        def offsets(self):
            return torch.tensor([0, 2])

        def lengths(self):
            return None

    v, o, n = compat.jagged_parts(Jagged())
    assert v.tolist() == [1, 2] and o.tolist() == [0, 2] and n is None


@pytest.mark.parametrize("fast_read", [True, False])
def test_jagged_parts_keeps_autograd_where_it_matters(fast_read, monkeypatch):
    """A float jagged tensor requiring grad under grad mode takes ``values()`` (its autograd
    view of the NestedTensor) even with the private paths on; under no_grad, or not requiring
    grad, the fields. ``fast_read``: ``requires_grad`` read without ``__torch_function__``."""
    if not fast_read:
        monkeypatch.setattr(compat, "_NO_SUBCLASS_TORCH_FUNCTION", None)
    x = torch.nested.nested_tensor([torch.randn(3), torch.randn(2)], layout=torch.jagged,
                                   requires_grad=True)
    with private_paths(True):
        v, _, _ = compat.jagged_parts(x)
        assert v is not x._values and v.requires_grad
        (v * 2).sum().backward()
        assert x.grad is not None
        with torch.no_grad():
            assert compat.jagged_parts(x)[0] is x._values
        y = x.detach()
        assert compat.jagged_parts(y)[0] is y._values
        z = torch.nested.nested_tensor_from_jagged(torch.randn(5, requires_grad=True),
                                                   torch.tensor([0, 2, 5])) * 2  # an op's result
        assert z.requires_grad and compat.jagged_parts(z)[0] is not z._values


def test_rank_2_jagged_tensors_are_ragged_in_dim_1():
    """Why callers need no ``_ragged_idx`` check: rank 2 forces ragged dim 1."""
    values, offsets = torch.arange(10), torch.tensor([0, 3, 3, 10])
    made = [
        torch.nested.nested_tensor_from_jagged(values, offsets),
        torch.nested.nested_tensor_from_jagged(values, offsets, lengths=torch.tensor([2, 0, 5])),
        torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=1),
        torch.nested.nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged),
        torch.nested.as_nested_tensor([torch.arange(3), torch.arange(5)], layout=torch.jagged),
        # rank 3 ragged in dim 2, reduced to rank 2 over the dense dim 1
        torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)],
                                   layout=torch.jagged).transpose(1, 2).select(1, 0),
    ]
    for x in made:
        assert x.dim() == 2 and x._ragged_idx == 1
    x = made[0]
    for attempt in (lambda: x.transpose(0, 1), lambda: x.permute(1, 0),
                    lambda: torch.nested.nested_tensor_from_jagged(values, offsets,
                                                                   jagged_dim=0)):
        with pytest.raises((ValueError, RuntimeError)):
            attempt()


# ---------------------------------------------------------------------------------- sparse
@st.composite
def sparse_tensors(draw):
    """(x, stored indices (k, nnz), stored values (nnz,), has duplicate positions)."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=2, max_size=3)))
    positions = st.tuples(*[st.integers(0, n - 1) for n in shape])
    pos = draw(st.lists(positions, max_size=12))
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.float32]))
    vals = torch.tensor(draw(st.lists(st.integers(-50, 50), min_size=len(pos),
                                      max_size=len(pos))), dtype=dtype)
    idx = torch.tensor(pos, dtype=torch.int64).reshape(-1, len(shape)).T.contiguous()
    x = torch.sparse_coo_tensor(idx, vals, shape, check_invariants=True)
    if draw(st.booleans()):
        x = x.coalesce()
        idx, vals = x.indices(), x.values()
    return x, idx, vals, len(set(pos)) < len(pos)


@settings(max_examples=examples(80), deadline=None)
@given(sparse_tensors())
def test_sparse_parts_private_equals_public(case):
    x, idx, vals, duplicates = case
    (i1, v1), (i2, v2) = both(compat.sparse_parts, x)
    # the private path: every stored entry, in stored order
    assert torch.equal(i1, idx) and torch.equal(v1, vals) and i1.shape == (x.dim(), vals.numel())
    if x.is_coalesced():  # the fallback reads the same tensors
        assert same_tensor(i1, i2) and same_tensor(v1, v2)
        return
    # uncoalesced: the fallback coalesces (sorted; duplicate positions summed, as documented)
    c = torch.sparse_coo_tensor(i1, v1, x.shape, check_invariants=True).coalesce()
    assert torch.equal(i2, c.indices()) and torch.equal(v2, c.values())
    if not duplicates:  # the same entries, sorted by position
        assert i2.shape == i1.shape and sorted(i1.T.tolist()) == i2.T.tolist()


def test_sparse_parts_fallback_when_the_private_accessors_are_missing(monkeypatch):
    x = torch.sparse_coo_tensor(torch.tensor([[1, 0, 1], [2, 1, 2]]), torch.tensor([5, 6, 7]),
                                (3, 4), check_invariants=True)
    assert compat.sparse_parts(x)[1].tolist() == [5, 6, 7]  # stored order, duplicates kept
    monkeypatch.setattr(compat, "_HAS_SPARSE_PRIVATE", False)
    i, v = compat.sparse_parts(x)
    assert i.tolist() == [[0, 1], [1, 2]] and v.tolist() == [6, 12]  # coalesced: 5 + 7


def test_sparse_parts_switched_off_calls_no_private_accessor(monkeypatch):
    def forbidden(self):
        raise AssertionError("a private accessor was called")

    x = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (2,),
                                check_invariants=True)
    x = torch.stack([x, x])  # rank 2, uncoalesced
    monkeypatch.setattr(torch.Tensor, "_indices", forbidden, raising=False)
    with private_paths(False):
        i, v = compat.sparse_parts(x)
    assert i.shape == (2, 4) and v.tolist() == [1.0, 2.0, 1.0, 2.0]
    with private_paths(True), pytest.raises(AssertionError, match="private accessor"):
        compat.sparse_parts(x)


# ------------------------------------------------------------------------------- the rule
PRIVATE_TORCH = re.compile(
    r"torch\._[A-Za-z]"                                     # torch._C, torch._nested_..., ...
    r"|torch\.ops\.aten\._"                                 # private ATen ops
    r"|\._(values|offsets|lengths|indices|ragged_idx|nnz)\b"  # private tensor accessors
    r"|getattr\([^)]*[\"']_(values|offsets|lengths|ragged_idx)[\"']")
# The names compat.py declares (PRIVATE_NAMES' last parts), DCP's per-rank index file name and
# Python 3.13's pathlib module; not the fields of DCP's index records that checkpoint.py reads
# (``info.relative_path``, ...), which only compat.py's list names as private.
_FIELDS_READ_ELSEWHERE = {"relative_path", "transform_descriptors", "load_id"}
_DECLARED = sorted({k.rsplit(":", 1)[1].rsplit(".", 1)[-1] for k in compat.PRIVATE_NAMES}
                   - _FIELDS_READ_ELSEWHERE)
DECLARED_NAME = re.compile(r"\b(" + "|".join(map(re.escape, _DECLARED)) + r")\b"
                           r"|pathlib\._local|__\{rank\}")
# Files that still hold a private use, to be switched to compat.py (then removed from here).
PENDING: set[str] = set()  # files still to move onto compat.py, relative to embcore/


def test_no_torch_private_api_outside_compat():
    root = Path(compat.__file__).parent.parent  # embcore/
    found = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name == "base/compat.py" or name in PENDING:
            continue
        hits = [f"{name}:{i}: {line.strip()}"
                for i, line in enumerate(path.read_text().splitlines(), 1)
                if PRIVATE_TORCH.search(line) or DECLARED_NAME.search(line)]
        if hits:
            found[name] = hits
    assert not found, f"torch private APIs outside embcore/base/compat.py: {found}"


def test_the_rule_scans_the_whole_package():
    """The scan above reads every layer, and its patterns catch what compat.py declares."""
    root = Path(compat.__file__).parent.parent
    scanned = {p.relative_to(root).parts[0] for p in root.rglob("*.py")}
    assert {"base", "config", "ops", "inputs", "planning", "state", "step", "serving",
            "checkpoint.py"} <= scanned
    for line in ('("torch.distributed.checkpoint.filesystem", "_StorageInfo")',
                 "Shard.local_shard_size_and_offset(n, world, r)", 'f"__{rank}.metadata"',
                 '("pathlib", "pathlib._local")', "torch.serialization._get_layout"):
        assert DECLARED_NAME.search(line) or PRIVATE_TORCH.search(line), line
    assert not DECLARED_NAME.search("md.storage_meta.load_id = self.load_id")


# ------------------------------------------------------------------ the torch release checked
def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``"2.13.0+cpu"``."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def test_installed_torch_is_in_the_tested_range():
    first, last = compat.TESTED_TORCH
    assert first <= last
    got = _release(torch.__version__)
    assert first <= got <= last, (
        f"torch {torch.__version__} is outside the releases embcore/base/compat.py was checked "
        f"on ({first[0]}.{first[1]} to {last[0]}.{last[1]}). Re-check on it each private name of "
        f"compat.PRIVATE_NAMES (what each is for is listed there): the DCP index classes the "
        f"checkpoint unpickler allows (run tests/test_checkpoint.py), DTensor's Shard(0) chunk "
        f"rule (tests/test_shards.py), the jagged / sparse fields (tests/test_compat.py, "
        f"tests/test_input_safety.py); then widen compat.TESTED_TORCH.")


def test_pyproject_requires_the_tested_range():
    """pyproject.toml's torch requirement is ``compat.TESTED_TORCH``: from its first release up to
    (not including) the release after its last, so that pip installs only a checked torch."""
    pyproject = (Path(compat.__file__).parents[2] / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", pyproject, flags=re.M | re.S)
    assert deps, "pyproject.toml has no dependencies line"
    torch_spec = [d for d in re.findall(r'"([^"]*)"', deps.group(1)) if d.startswith("torch")]
    (first_major, first_minor), (last_major, last_minor) = compat.TESTED_TORCH
    want = f"torch>={first_major}.{first_minor},<{last_major}.{last_minor + 1}"
    assert [s.replace(" ", "") for s in torch_spec] == [want], (
        f"pyproject.toml requires {torch_spec}, but embcore/base/compat.py's TESTED_TORCH says "
        f"{want}: make them the same range (the releases the suite was run on)")


def _resolve(spec: str) -> object:
    """The object ``"module:attr.path"`` names; the last part may also be a dataclass field or
    an annotated (instance) field of a class. Raises AttributeError / ImportError if gone."""
    module, path = spec.split(":")
    obj: object = importlib.import_module(module)
    parts = path.split(".")
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if i == len(parts) - 1 and inspect.isclass(obj):
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) \
                else set()
            for c in obj.__mro__:
                fields |= set(inspect.get_annotations(c))
            if part in fields:
                return part
        raise AttributeError(f"{spec}: {part!r} is gone")
    return obj


def test_every_declared_private_name_exists():
    missing = {}
    for spec, use in compat.PRIVATE_NAMES.items():
        try:
            _resolve(spec)
        except (ImportError, AttributeError) as e:
            missing[spec] = f"{use} ({type(e).__name__}: {e})"
    assert not missing, (f"torch {torch.__version__} lacks private names embcore relies on "
                         f"(compat.PRIVATE_NAMES): {missing}")


def test_resolve_refuses_a_name_that_is_gone():
    assert _resolve("torch.distributed.checkpoint.filesystem:_StorageInfo.relative_path")
    for spec in ("torch:Tensor._no_such_accessor", "torch.no_such_module:x",
                 "torch.distributed.checkpoint.metadata:StorageMeta.no_such_field"):
        with pytest.raises((ImportError, AttributeError)):
            _resolve(spec)


def test_dcp_index_private_globals_are_declared():
    for module, name in compat.DCP_INDEX_PRIVATE_GLOBALS:
        assert f"{module}:{name}" in compat.PRIVATE_NAMES


# ------------------------------------------------------------------------------ DCP's index
def test_dcp_index_names_are_dcp_s(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader, filesystem

    assert compat.DCP_INDEX == filesystem._metadata_fn == ".metadata"
    reader = FileSystemReader(tmp_path)
    for rank in (None, 0, 3):
        assert Path(reader._get_metadata_path(rank)) == tmp_path / compat.dcp_index_name(rank)
    assert compat.dcp_index_name(3) == "__3.metadata"


def test_dcp_warns_as_checkpoint_py_expects(tmp_path):
    """The warning checkpoint.py silences is the one DCP's save and load give without a group."""
    import torch.distributed.checkpoint as dcp

    state = {"x": torch.arange(4.0)}
    for call in (lambda: dcp.save(state, checkpoint_id=tmp_path, no_dist=True),
                 lambda: dcp.load(state, checkpoint_id=tmp_path, no_dist=True)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            call()
        assert any(str(w.message).startswith(compat.DCP_NO_PROCESS_GROUP_WARNING)
                   for w in seen), [str(w.message) for w in seen]


def test_paths_pickle_under_a_listed_module():
    assert pathlib.PosixPath.__module__ in compat.PICKLED_PATH_MODULES
    assert pathlib.Path.__module__ in compat.PICKLED_PATH_MODULES


# ------------------------------------------------------------------------ Shard(0) chunks
def test_shard_chunk_private_equals_public():
    for rows in range(23):
        for world in range(1, 7):
            chunks = [both(compat.shard_chunk, rows, world, r) for r in range(world)]
            for on, off in chunks:
                assert on == off and all(type(v) is int for v in on)
            # torch.chunk's blocks, then empty chunks starting at the end
            blocks = [(int(c[0]), c.numel()) if c.numel() else None
                      for c in torch.arange(rows).chunk(world)] if rows else []
            want = blocks + [(rows, 0)] * (world - len(blocks))
            assert [on for on, _ in chunks] == want, (rows, world)


def test_shard_chunk_without_dtensor_s_rule_uses_the_fallback(monkeypatch):
    from torch.distributed.tensor import Shard

    def forbidden(*args):
        raise AssertionError("DTensor's rule was called")

    monkeypatch.setattr(Shard, "local_shard_size_and_offset", forbidden)
    with private_paths(False):
        assert compat.shard_chunk(10, 4, 3) == (9, 1)
    with private_paths(True), pytest.raises(AssertionError, match="DTensor's rule"):
        compat.shard_chunk(10, 4, 3)
    monkeypatch.delattr(Shard, "local_shard_size_and_offset")
    with private_paths(True):
        assert compat.shard_chunk(10, 4, 3) == (9, 1) and compat.shard_chunk(2, 4, 3) == (2, 0)


_FX_SCRIPT = """
import logging, sys
import torch
if sys.argv[1] == "embcore":
    import embcore
torch.nested.nested_tensor_from_jagged(torch.tensor([1, 2, 9]), torch.tensor([0, 2, 3]))
torch.nested.nested_tensor_from_jagged(torch.tensor([4]), torch.tensor([0, 1]))
logging.getLogger("torch.fx._symbolic_trace").warning("another notice of that logger")
"""


def test_torchs_is_fx_tracing_notice_is_quiet_and_nothing_else():
    """Building jagged ids (torch.nested.nested_tensor_from_jagged, as the guide's first
    example does) makes torch log its is_fx_tracing notice; with embcore imported that one
    message is dropped, and another message of the same logger still shows."""
    runs = {who: subprocess.run([sys.executable, "-c", _FX_SCRIPT, who], capture_output=True,
                                text=True, timeout=120, check=True)
            for who in ("torch", "embcore")}
    assert "another notice of that logger" in runs["embcore"].stderr
    assert "is_fx_tracing" not in runs["embcore"].stderr, runs["embcore"].stderr
    if torch.__version__.startswith("2.13"):  # the torch it was found on: without embcore
        assert "is_fx_tracing will return true" in runs["torch"].stderr  # the notice shows
