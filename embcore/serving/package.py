"""AOTInductor packages that check what they serve: ``package_program`` and ``load_package``.

An AOTInductor package (``.pt2``) answers any tensors of the right count: it reads their bytes as
the traced dtypes and contiguous shapes, whatever they are (a column ``batch[:, 0]`` read as if
contiguous, int32 ids read as int64, a dict's keys taken in the caller's order), and its loader
checks no checksum. ``package_program`` compiles an exported program into a package and adds
one archive member, ``<archive>/extra/embcore_package.json``: what each input was traced as
(structure, dtype, rank, static sizes, size ranges, and for a serving module's package each
input's feature and role) and the SHA-256 of every other member (the compiled library holds the
tables). ``load_package`` verifies the checksums, loads the package with torch's loader and
returns a ``ServingPackage``: a call checks its inputs against what was traced and refuses the
rest with an error naming the input, its feature and the fix (docs/semantics.md section 12).

The package stays a plain AOTInductor package: torch alone loads it (the extra member is
ignored), without the checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import zipfile
from collections.abc import Mapping
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from ..base.compat import compile_aoti_package, load_aoti_package

MANIFEST = "extra/embcore_package.json"  # under the archive's root folder
FORMAT = "embcore AOTInductor package"
VERSION = 1


# ------------------------------------------------------------------------------ structure
def _structure(value: Any, path: str, leaves: list[tuple[str, torch.Tensor]]) -> Any:
    """A JSON description of the example ``value`` (tensors numbered in flattening order, as
    torch.export flattens them: dicts in their keys' order, tuples and lists in order)."""
    if isinstance(value, torch.Tensor):
        leaves.append((path, value))
        return len(leaves) - 1
    if value is None:
        return None
    if isinstance(value, dict):
        if not all(isinstance(k, str | int) for k in value):
            raise TypeError(f"{path}: a package's dict inputs take str or int keys, got "
                            f"{[type(k).__name__ for k in value]}")
        return {"dict": [[k, _structure(v, f"{path}[{k!r}]", leaves)] for k, v in value.items()]}
    if isinstance(value, tuple | list):
        return {"seq": [_structure(v, f"{path}[{i}]", leaves) for i, v in enumerate(value)]}
    raise TypeError(f"{path}: a package takes tensors, None, and dicts, tuples or lists of them; "
                    f"got {type(value).__name__}")


def _bound(x: Any) -> int | None:
    """A range constraint's bound as an int; None where infinite."""
    try:
        return int(str(x))  # (a sympy integer; torch's int_oo prints as "int_oo")
    except ValueError:
        return None


def describe_program(program: torch.export.ExportedProgram,
                     roles: Mapping[str, tuple[str, str, int | None]] | None = None
                     ) -> dict[str, Any]:
    """What ``program``'s inputs were traced as, for the manifest: the arguments' names, their
    structure, and each input tensor's ``name``, ``dtype``, ``shape`` (ints, or the names of
    its dynamic sizes), ``device``; ``roles``: ``{input name: (role, feature, rows)}`` (a
    serving module's: ``"ids"``, ``"offsets"``, ``"weights"`` or ``"weight offsets"``, the
    feature, and a static table's number of rows, else None)."""
    from torch.export.graph_signature import InputKind
    args, kwargs = program.example_inputs
    if kwargs:
        raise ValueError(f"package_program: trace the program with positional arguments only, "
                         f"got keyword arguments {sorted(kwargs)}")
    names = list(getattr(program.module_call_graph[0].signature, "forward_arg_names", None)
                 or [f"arg{i}" for i in range(len(args))])[:len(args)]
    leaves: list[tuple[str, torch.Tensor]] = []
    structure = [_structure(a, n, leaves) for a, n in zip(args, names)]
    user = [s.arg.name for s in program.graph_signature.input_specs
            if s.kind == InputKind.USER_INPUT]
    metas = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    user = [n for n in user if isinstance(metas.get(n), torch.Tensor)]  # (None: no input)
    if len(user) != len(leaves):
        raise ValueError(f"package_program: the program takes {len(user)} input tensors, its "
                         f"example {len(leaves)}")
    symbols: dict[str, list[int | None]] = {
        str(s): [_bound(r.lower), _bound(r.upper)] for s, r in program.range_constraints.items()}
    inputs = []
    for (name, example), placeholder in zip(leaves, user):
        val = metas[placeholder]
        shape: list[int | str] = [int(d) if isinstance(d, int) else str(d.node.expr)
                                  for d in getattr(val, "shape", example.shape)]
        role, feature, rows = (roles or {}).get(name, (None, None, None))
        inputs.append({"name": name, "dtype": str(example.dtype).removeprefix("torch."),
                       "shape": shape, "device": example.device.type, "role": role,
                       "feature": feature, "rows": rows})
    return {"arguments": names, "structure": structure, "inputs": inputs, "symbols": symbols}


# ------------------------------------------------------------------------------ the archive
def _root(archive: zipfile.ZipFile, path: Path) -> str:
    """The archive's root folder (``<name>/``: every member lies under it)."""
    names = archive.namelist()
    root = names[0].split("/", 1)[0] + "/" if names and "/" in names[0] else ""
    if not root or not all(n.startswith(root) for n in names):
        raise ValueError(f"{path}: not an AOTInductor package (its members lie under no one "
                         f"folder)")
    return root


def _digests(archive: zipfile.ZipFile, skip: str) -> dict[str, str]:
    """SHA-256 of every member but ``skip`` (zipfile checks each member's CRC as it reads)."""
    out = {}
    for info in archive.infolist():
        if info.filename == skip or info.is_dir():
            continue
        h = hashlib.sha256()
        try:
            with archive.open(info) as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except zipfile.BadZipFile:  # (its CRC-32 does not match: a changed member)
            out[info.filename] = "bad CRC-32"
            continue
        out[info.filename] = h.hexdigest()
    return out


def _body_digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def package_program(program: torch.export.ExportedProgram, path: str | os.PathLike[str], *,
                    inductor_configs: dict[str, Any] | None = None,
                    roles: Mapping[str, tuple[str, str, int | None]] | None = None,
                    progress: bool = True) -> Path:
    """Compiles ``program`` with AOTInductor into the package ``path`` (``.pt2``) and adds the
    manifest ``load_package`` checks: what the inputs were traced as and the SHA-256 of every
    member. Returns ``path``.

    Args:
        program: a ``torch.export`` program traced with positional arguments.
        path: the package's file; ends in ``.pt2``.
        inductor_configs: passed to AOTInductor's compiler.
        roles: ``{input name: (role, feature, rows)}`` (``ServingModule.compile_package``'s).
        progress: print a line to stderr before and after compiling (it takes seconds to a
            minute).

    Raises:
        ValueError: ``path`` does not end in ``.pt2``, or the program was traced with keyword
            arguments.
        RuntimeError: this torch has no AOTInductor.

    Example:
        >>> import torch, embcore as ec
        >>> program = torch.export.export(torch.nn.Linear(3, 2), (torch.ones(4, 3),))
        >>> ec.package_program(program, "linear.pt2")  # doctest: +SKIP
        >>> ec.load_package("linear.pt2")(torch.ones(4, 3)).shape  # doctest: +SKIP
        torch.Size([4, 2])
    """
    path = Path(path)
    if path.suffix != ".pt2":
        raise ValueError(f"package {path}: the name must end in .pt2 (AOTInductor loads "
                         f"packages by that suffix)")
    spec = describe_program(program, roles)
    path.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"embcore: compiling {path} with AOTInductor (a C++ build: seconds to a few "
              f"minutes)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    out = Path(compile_aoti_package(program, str(path), inductor_configs))
    write_manifest(out, spec)
    if progress:
        print(f"embcore: compiled {path} in {time.perf_counter() - start:.1f} s "
              f"({out.stat().st_size:,} bytes)", file=sys.stderr, flush=True)
    return out


def write_manifest(path: Path, spec: Mapping[str, Any]) -> None:
    """Adds the manifest to the package ``path``: ``spec`` (``describe_program``'s) and the
    SHA-256 of every member."""
    with zipfile.ZipFile(path, "a") as archive:  # (members stored, as AOTInductor stores them)
        member = _root(archive, path) + MANIFEST
        body = {"format": FORMAT, "version": VERSION, **spec,
                "files": _digests(archive, member)}
        archive.writestr(member, json.dumps({**body, "sha256": _body_digest(body)}, indent=1))


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the package ``path``, after verifying the SHA-256 of every member.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a package, no manifest (a package not written by ``package_program``
            or ``ServingModule.compile_package``), or a member whose bytes changed since."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no package at {path}")
    try:
        with zipfile.ZipFile(path) as archive:
            member = _root(archive, path) + MANIFEST
            if member not in archive.namelist():
                raise ValueError(f"{path}: no {MANIFEST} in the package: it was not written by "
                                 f"embcore (ServingModule.compile_package or "
                                 f"ec.package_program), so its inputs and bytes cannot be "
                                 f"checked; compile it with one of them")
            manifest = json.loads(archive.read(member))
            digests = _digests(archive, member)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, json.JSONDecodeError, OSError) as e:
        raise ValueError(f"{path}: not a readable package ({type(e).__name__}: {e}); "
                         f"compile it again") from None
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if manifest.get("format") != FORMAT or manifest.get("sha256") != _body_digest(body):
        raise ValueError(f"{path}: its manifest ({MANIFEST}) is damaged; compile it again")
    if manifest["version"] > VERSION:
        raise ValueError(f"{path}: manifest version {manifest['version']} is newer than this "
                         f"embcore reads ({VERSION}); upgrade embcore")
    want = manifest["files"]
    changed = sorted(n for n in set(want) | set(digests) if want.get(n) != digests.get(n))
    if changed:
        raise ValueError(f"{path}: {len(changed)} member(s) differ from the checksums written "
                         f"when it was compiled ({', '.join(changed[:3])}): the file is damaged "
                         f"or was changed; copy it again or compile it again")
    return manifest


# ------------------------------------------------------------------------------ the checks
class _Input:
    """One input tensor as traced."""

    def __init__(self, spec: Mapping[str, Any], dims: Mapping[str, str]) -> None:
        self.name: str = spec["name"]
        dtype = getattr(torch, spec["dtype"], None)
        self.dtype = dtype if isinstance(dtype, torch.dtype) else None
        self.dtype_name: str = spec["dtype"]
        self.shape: list[int | str] = spec["shape"]
        self.rank = len(self.shape)
        self.device: str = spec["device"]
        self.role: str | None = spec.get("role")
        self.feature: str | None = spec.get("feature")
        self.rows: int | None = spec.get("rows")
        shown = ", ".join(str(d) if isinstance(d, int) else dims[d] for d in self.shape)
        self.expects = f"{self.dtype_name} ({shown}{',' if self.rank == 1 else ''})"

    def who(self) -> str:
        """How errors name this input: its feature and role where known."""
        if self.feature is not None:
            return f"feature {self.feature!r}: {self.role} ({self.name})"
        return f"input {self.name}"


class ServingPackage:
    """An AOTInductor package loaded by ``load_package``: calls check their inputs against what
    the package was traced with (structure, dtype, device, rank, contiguity, static sizes and
    the dynamic ones' ranges and equalities; for a serving module's package, jagged offsets,
    weights that mirror their ids, and a static table's ids in range), then run the package.

    ``package(*args)`` (or with the traced arguments' names as keywords) answers as the traced
    module; ``expects`` says what each input must be; ``manifest`` is the package's record.
    A dict's keys may come in any order (each input is taken by its key); an argument traced as
    None may be left out.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], model: Any,
                 check_inputs: bool) -> None:
        self.path = path
        self.manifest = manifest
        self._model = model
        self._check = check_inputs
        self._arguments: list[str] = manifest["arguments"]
        self._structure: list[Any] = manifest["structure"]
        self._symbols: dict[str, list[int | None]] = manifest["symbols"]
        dims: dict[str, str] = {}
        for spec in manifest["inputs"]:
            for d in spec["shape"]:
                if isinstance(d, str) and d not in dims:
                    dims[d] = f"N{len(dims)}" if d in self._symbols else d
        self._inputs = [_Input(s, dims) for s in manifest["inputs"]]
        by_feature: dict[tuple[str | None, str | None], int] = {
            (i.feature, i.role): k for k, i in enumerate(self._inputs) if i.feature is not None}
        # (ids values, offsets) and (weights, weight offsets, ids values, ids offsets) indices
        self._jagged = [(k, by_feature[(i.feature, "offsets")]) for k, i in
                        enumerate(self._inputs) if i.role == "ids"
                        and (i.feature, "offsets") in by_feature]
        self._weighted = [(k, by_feature.get((i.feature, "weight offsets")),
                           by_feature[(i.feature, "ids")], by_feature.get((i.feature, "offsets")))
                          for k, i in enumerate(self._inputs) if i.role == "weights"
                          and (i.feature, "ids") in by_feature]
        self._ranged = [(k, i.rows) for k, i in enumerate(self._inputs)
                        if i.role == "ids" and i.rows is not None]
        # the structure as steps: node i is nodes[parent][key] (node p < 0: argument -p - 1),
        # and what it must be: a dict of n keys, a tuple / list of n, None, or a tensor
        self._steps: list[tuple[int, Any, str, int]] = []
        for a, s in enumerate(self._structure):
            self._compile(s, -a - 1, None)
        self._sized = [(name, lo, hi) for name, (lo, hi) in self._symbols.items()
                       if (lo is not None and lo > 0) or hi is not None]
        self._fast = [(i.dtype, i.rank, i.device,
                       [(d, w) for d, w in enumerate(i.shape) if isinstance(w, int)],
                       [(d, w) for d, w in enumerate(i.shape) if isinstance(w, str)])
                      for i in self._inputs]
        self.expects = (f"({', '.join(self._arguments)}): "
                        + "; ".join(f"{i.name} {i.expects}" for i in self._inputs)
                        + ". Sizes named N0, N1, ... are free (any size in range), the same name "
                          "the same size; every tensor contiguous")

    def __repr__(self) -> str:
        return f"ServingPackage({str(self.path)!r}, takes {self.expects})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._check:
            return self._model(*args, **kwargs)
        leaves = self._fast_leaves(args) if not kwargs else None
        if leaves is None:
            leaves = self._flatten(args, kwargs)  # (names what is wrong)
        self._check_tensors(leaves)
        return self._model(*leaves)

    # -- structure
    def _compile(self, s: Any, parent: int, key: Any) -> None:
        here = len(self._steps)
        if isinstance(s, int):
            self._steps.append((parent, key, "tensor", 0))
        elif s is None:
            self._steps.append((parent, key, "none", 0))
        elif "dict" in s:
            self._steps.append((parent, key, "dict", len(s["dict"])))
            for k, sub in s["dict"]:
                self._compile(sub, here, k)
        else:
            self._steps.append((parent, key, "seq", len(s["seq"])))
            for i, sub in enumerate(s["seq"]):
                self._compile(sub, here, i)

    def _fast_leaves(self, args: tuple[Any, ...]) -> list[torch.Tensor] | None:
        """The input tensors of positional ``args`` in the traced order, or None where anything
        differs from the traced structure (then ``_flatten`` says what)."""
        n = len(self._arguments)
        if len(args) != n:
            return None
        nodes: list[Any] = []
        leaves: list[torch.Tensor] = []
        try:
            for parent, key, kind, size in self._steps:
                node = args[-parent - 1] if parent < 0 else nodes[parent][key]
                nodes.append(node)
                if kind == "tensor":
                    if not isinstance(node, torch.Tensor):
                        return None
                    leaves.append(node)
                elif kind == "none":
                    if node is not None:
                        return None
                elif kind == "dict":
                    if not isinstance(node, dict) or len(node) != size:
                        return None
                elif not isinstance(node, tuple | list) or len(node) != size:
                    return None
        except (KeyError, IndexError, TypeError):
            return None
        return leaves

    def _flatten(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        n = len(self._arguments)
        values = list(args)
        if kwargs:
            unknown = sorted(set(kwargs) - set(self._arguments))
            if unknown:
                raise TypeError(f"{self.path.name}: unknown argument(s) {unknown}; the package "
                                f"takes {self.expects}")
            values += [None] * (n - len(values))
            for k, v in kwargs.items():
                i = self._arguments.index(k)
                if i < len(args):
                    raise TypeError(f"{self.path.name}: argument {k!r} given twice")
                values[i] = v
        while len(values) > n and values[-1] is None:
            values.pop()  # (an argument traced as absent, given as None)
        values += [None] * (n - len(values))
        if len(values) != n:
            raise TypeError(f"{self.path.name}: {len(args)} arguments given; the package takes "
                            f"{self.expects}")
        leaves: list[torch.Tensor] = []
        for s, v, name in zip(self._structure, values, self._arguments):
            self._walk(s, v, name, leaves)
        return leaves

    def _walk(self, s: Any, v: Any, path: str, leaves: list[torch.Tensor]) -> None:
        if isinstance(s, int):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"{self._inputs[s].who()} must be a tensor, "
                                f"{self._inputs[s].expects}; got {type(v).__name__}")
            leaves.append(v)
        elif s is None:
            if v is not None:
                raise TypeError(f"{path}: the package was traced with None there and takes "
                                f"nothing (it takes {self.expects}); got {type(v).__name__}")
        elif "dict" in s:
            if not isinstance(v, Mapping):
                raise TypeError(f"{path} must be a dict of keys {[k for k, _ in s['dict']]} as "
                                f"traced; got {type(v).__name__}")
            keys = [k for k, _ in s["dict"]]
            if set(v) != set(keys):
                raise ValueError(f"{path}: keys {sorted(map(str, v))} differ from the traced "
                                 f"keys {keys}: missing {[k for k in keys if k not in v]}, "
                                 f"unexpected {[k for k in v if k not in keys]}")
            for k, sub in s["dict"]:
                self._walk(sub, v[k], f"{path}[{k!r}]", leaves)
        else:
            items = s["seq"]
            if not isinstance(v, tuple | list) or len(v) != len(items):
                got = (f"a {type(v).__name__} of {len(v)}" if isinstance(v, tuple | list)
                       else type(v).__name__)
                pair = len(items) == 2 and all(isinstance(i, int) for i in items)
                raise TypeError(f"{path} must be a tuple of {len(items)} as traced"
                                + (" (a jagged (values, offsets) pair)" if pair else "")
                                + f"; got {got}")
            for i, (sub, x) in enumerate(zip(items, v)):
                self._walk(sub, x, f"{path}[{i}]", leaves)

    # -- tensors
    def _check_tensors(self, leaves: list[torch.Tensor]) -> None:
        sizes: dict[str, int] = {}
        strided = torch.strided
        for k, ((dtype, rank, device, static, dynamic), x) in enumerate(zip(self._fast, leaves)):
            if (x.dtype is not dtype or x.dim() != rank or x.layout is not strided or x.is_nested
                    or not (x.is_cpu if device == "cpu" else x.device.type == device)
                    or not x.is_contiguous()):
                self._refuse(self._inputs[k], x)
            shape = x.shape
            for d, want in static:
                if shape[d] != want:
                    raise ValueError(f"{self._inputs[k].who()} must be "
                                     f"{self._inputs[k].expects} as traced, got shape "
                                     f"{tuple(shape)}")
            for d, name in dynamic:
                got = shape[d]
                if sizes.setdefault(name, got) != got:
                    raise ValueError(f"{self._inputs[k].who()}: its size {got} in dim {d} must "
                                     f"equal the other inputs' traced as the same size (here "
                                     f"{sizes[name]}): the example the package was compiled "
                                     f"from gave them one size, and the package assumes it "
                                     f"(compile it from an example whose sizes differ); it "
                                     f"takes {self.expects}")
        for name, lo, hi in self._sized:
            size = sizes.get(name)
            if size is not None and ((lo is not None and size < lo) or
                                     (hi is not None and size > hi)):
                where = next(i for i in self._inputs if name in i.shape)
                raise ValueError(f"{where.who()}: a size of {size} is outside the range the "
                                 f"package was traced for ([{lo}, {hi if hi is not None else ''}"
                                 f"]); it takes {self.expects}")
        for v, o in self._jagged:
            _check_offsets(self._inputs[o], leaves[o], leaves[v].numel())
        for w, w_off, ids, ids_off in self._weighted:
            if leaves[w].shape != leaves[ids].shape:
                raise ValueError(f"{self._inputs[w].who()}: shape {tuple(leaves[w].shape)} "
                                 f"must be its ids' {tuple(leaves[ids].shape)}")
            if w_off is not None and ids_off is not None and \
                    leaves[w_off] is not leaves[ids_off] and \
                    not torch.equal(leaves[w_off], leaves[ids_off]):
                raise ValueError(f"{self._inputs[w_off].who()} must equal its ids' offsets "
                                 f"(weights mirror their ids)")
        for k, rows in self._ranged:
            x = leaves[k]
            if not x.numel():
                continue
            if x.numel() <= _SMALL:  # (a few ids: Python's min and max are the cheaper)
                values = x.tolist()
                least, most = min(values), max(values)
            else:
                least, most = (int(t) for t in torch.aminmax(x))
            if least < 0 or most >= rows:
                raise ValueError(f"{self._inputs[k].who()} has id "
                                 f"{least if least < 0 else most} but its table has {rows} "
                                 f"rows; ids must be in [0, {rows})")

    def _refuse(self, spec: _Input, x: torch.Tensor) -> None:
        """Raises what is wrong with input ``x`` (one of the fast checks failed)."""
        if x.layout != torch.strided or x.is_nested:
            raise TypeError(f"{spec.who()} must be a dense (strided) tensor, "
                            f"{spec.expects}; got layout {x.layout}")
        if x.dtype != spec.dtype:
            raise TypeError(f"{spec.who()} must be {spec.dtype_name} as traced, got "
                            f"{x.dtype}; convert it with .to(torch.{spec.dtype_name})")
        if x.dim() != spec.rank:
            raise ValueError(f"{spec.who()} must be {spec.expects} as traced, got shape "
                             f"{tuple(x.shape)}; give the traced rank (or compile the "
                             f"package from an example of this rank)")
        if x.device.type != spec.device:
            raise ValueError(f"{spec.who()} must be on {spec.device} as traced, got "
                             f"{x.device}; move it with .to({spec.device!r})")
        raise ValueError(f"{spec.who()} is not contiguous (a column or a slice of a larger "
                         f"tensor?), shape {tuple(x.shape)} strides {x.stride()}; the package "
                         f"reads its bytes as contiguous: pass .contiguous()")


_SMALL = 64  # up to this many entries, checks read them with tolist() (cheaper than torch ops)


def _check_offsets(spec: _Input, offsets: torch.Tensor, n: int) -> None:
    """Jagged offsets: from 0, never decreasing, to the number of values ``n``."""
    m = offsets.numel()
    if m <= _SMALL:
        o = offsets.tolist()
        bad = not o or o[0] != 0 or o[-1] != n or any(a > b for a, b in pairwise(o))
    else:
        bad = (int(offsets[0]) != 0 or int(offsets[-1]) != n
               or bool((offsets[1:] < offsets[:-1]).any()))
    if bad:
        raise ValueError(f"{spec.who()} must run from 0, never decreasing, to the number of "
                         f"values ({n}); got {offsets.tolist()[:8]}"
                         f"{' ...' if m > 8 else ''}: offsets = [0, cumsum of the bags' "
                         f"lengths]")


def load_package(path: str | os.PathLike[str], *, check_inputs: bool = True) -> ServingPackage:
    """Loads an AOTInductor package written by ``ServingModule.compile_package`` (or
    ``package_program``), after verifying the SHA-256 of each of its members (the compiled
    library holds the tables); its calls check their inputs.

    Args:
        path: the ``.pt2`` file.
        check_inputs: check each call's inputs against what was traced (the default); False
            calls the package as torch's loader does, on inputs validated before.

    Returns:
        A ``ServingPackage``: ``package(*args)`` answers as the traced module, bit for bit on
        the CPU; ``package.expects`` says what each input must be.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a package, one without embcore's manifest, or one whose bytes changed
            since it was compiled.
        RuntimeError: this torch has no AOTInductor.

    Example:
        >>> import torch, embcore as ec
        >>> t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
        >>> served = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "sgd").for_serving()
        >>> served.compile_package("lookup.pt2", {"f": torch.tensor([1, 2])})  # doctest: +SKIP
        >>> package = ec.load_package("lookup.pt2")  # doctest: +SKIP
        >>> package({"f": torch.tensor([3, 4, 5])})["f"].shape  # doctest: +SKIP
        torch.Size([3, 2])
    """
    path = Path(path)
    manifest = read_manifest(path)
    return ServingPackage(path, manifest, load_aoti_package(str(path)), check_inputs)

