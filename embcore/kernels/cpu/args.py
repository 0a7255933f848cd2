"""The fused kernels' arguments by name and kind: each C function's ctypes signature and the
checks of every call come from one declaration (the CPU package declares every kernel beside its
wrapper).

A kernel is ``Kernel(name, result, [(argument, kind), ...])`` in the C function's order, with the
C names. The kinds: ``read(I64)`` / ``written(F32)`` (a contiguous CPU tensor of one of the
dtypes, passed as the address of its data), ``read_rows`` / ``written_rows`` (2-D, each row
contiguous, any row stride), ``PartsArg()`` (a list of int64 tensors), ``array(ctype)`` (a ctypes
array the wrapper builds), ``allocated`` (an address inside the wrapper's own new buffer),
``HYPER`` (a ``Hyper``), and the scalars ``INT64``, ``INT``, ``DOUBLE``. A tensor of the wrong
dtype, layout, device or length is a ``TypeError`` / ``ValueError`` naming the kernel and the
argument, raised before the kernel runs; a scalar of the wrong type, a ``TypeError`` naming it.
A kernel declared ``packed=True`` (the step's hot kernels) is also exported as
``<name>_packed(slots)`` (csrc/packed.h), which ``Kernel.partial``'s calls use: the arguments in
one array of int64 slots, one ctypes conversion a call.
"""

from __future__ import annotations

import ctypes
import operator
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ...config.dtypes import SCALED
from ...numerics.rounding import ROW_TYPES
from ..hyper import Hyper

# ---- the kernels' arguments, by name and kind --------------------------------------------------
# A kernel is declared as [(name, kind), ...] in the C function's order, with the C names. The
# kinds (below) give each argument's ctypes type and, for the tensors and the Hyper, the check of
# every call: a tensor argument is passed as ``(tensor, n)``, n its number of elements where the
# wrapper knows it (None: any), and arrives in C as the address of its data.

F32, I64, I32 = (torch.float32,), (torch.int64,), (torch.int32,)
ROWS = (torch.float32, torch.float16, torch.bfloat16)  # a table's rows: float32 or 16-bit
I16 = (torch.int16,)
# The row types of ec_lookup and ec_sparse_update: numerics/rounding.py's ROW_TYPES and the
# 8-bit ones (csrc/fp8.h's RowType8), which have a float32 scale per row ("row_scales").
UPDATE_ROW_TYPES = ROW_TYPES | {torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
U8 = (torch.uint8, torch.bool)  # a byte per flag: bool tensors are passed as they are
ANY = None  # any dtype (row moves: bytes)
_DTYPE_NAMES = {torch.float32: "_float32", torch.int64: "_int64", torch.int32: "_int32",
                torch.uint8: "_uint8", torch.bool: "_bool", torch.float16: "_float16",
                torch.bfloat16: "_bfloat16", torch.int16: "_int16",
                torch.float8_e4m3fn: "_float8_e4m3fn", torch.float8_e5m2: "_float8_e5m2"}
_CHECK_SCOPE = {name: dtype for dtype, name in _DTYPE_NAMES.items()} | {"_strided": torch.strided}


def rejected(kernel: str, arg: str, what: str, got: str, expected: object,
              error: type[Exception] = ValueError) -> Exception:
    """The error of every failed check: the kernel, the argument, what it must be and what came."""
    return error(f"{kernel}: argument {arg!r} must be {what}, got {got} (expected {expected})")


def check_row_scales(kernel: str, table: torch.Tensor, row_scales: torch.Tensor | None) -> None:
    """An 8-bit ``table`` comes with its rows' scales ``row_scales``, another without
    (ValueError naming ``kernel``)."""
    if (table.dtype in SCALED) != (row_scales is not None):
        raise ValueError(f"{kernel}: an 8-bit table takes its rows' float32 scales "
                         f"'row_scales' (N, 1), other tables none; got a {table.dtype} table "
                         f"and row_scales {'None' if row_scales is None else 'given'}")


def _shape(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} and strides {t.stride()}"


class Scalar:
    """A number passed by value (ctypes converts it; a wrong type is a TypeError at the call)."""

    checked = False

    def __init__(self, ctype: Any, name: str) -> None:
        self.ctype, self.name = ctype, name

    def __repr__(self) -> str:
        return self.name


INT64 = Scalar(ctypes.c_int64, "int64")
INT = Scalar(ctypes.c_int, "int")
DOUBLE = Scalar(ctypes.c_double, "double")
STRING = Scalar(ctypes.c_char_p, "string")


class TensorArg:
    """A contiguous, strided CPU tensor of one of ``dtypes``, passed as the address of its data;
    ``writes``: the kernel writes it (it may read it too); ``optional``: None passes nullptr;
    ``dim``: its number of dimensions, where the wrapper reads its shape; ``nonempty``: the
    kernel reads its first element whatever the length. Passed as ``(tensor, n)``: n its number
    of elements, or None where the wrapper does not know it."""

    checked = True
    ctype = ctypes.c_void_p

    def __init__(self, dtypes: tuple[torch.dtype, ...], *, writes: bool, optional: bool = False,
                 dim: int | None = None, nonempty: bool = False) -> None:
        self.dtypes, self.writes, self.optional = dtypes, writes, optional
        self.dim, self.nonempty = dim, nonempty
        self._ok = eval(f"lambda t, n: {self.condition('t', 'n')}", dict(_CHECK_SCOPE))

    def __repr__(self) -> str:
        dtypes = "/".join(str(d).removeprefix("torch.") for d in self.dtypes)
        dim = f" {self.dim}-D" if self.dim is not None else ""
        return (f"a contiguous{dim} CPU {dtypes} tensor{' (non-empty)' if self.nonempty else ''}"
                f"{' or None' if self.optional else ''}, {'written' if self.writes else 'read'}")

    def condition(self, t: str, n: str) -> str:
        """The check, as a Python expression over the tensor ``t`` and the length ``n`` (compiled
        into every kernel's call, see ``Kernel``: one condition of attribute reads, about 0.3
        us a tensor)."""
        dtypes = " or ".join(f"{t}.dtype is {_DTYPE_NAMES[d]}" for d in self.dtypes)
        parts = [f"({dtypes})" if len(self.dtypes) > 1 else dtypes,
                 f"{t}.layout is _strided", f"{t}.is_cpu", f"{t}.is_contiguous()",
                 f"({n} is None or {t}.numel() == {n})"]
        if self.dim is not None:
            parts.append(f"{t}.dim() == {self.dim}")
        if self.nonempty:
            parts.append(f"{t}.numel() > 0")
        return " and ".join(parts)

    def address(self, kernel: str, arg: str, value: tuple[Any, int | None],
                index: int | None = None) -> int | None:
        """The data's address of ``value = (tensor, n)`` after the checks (``index``: the
        argument is element ``index`` of a list)."""
        t, n = value
        if t is None and self.optional:
            return None
        try:
            if self._ok(t, n):
                return t.data_ptr()
        except AttributeError:
            pass
        raise self.failure(kernel, arg if index is None else f"{arg}[{index}]", t, n)

    def failure(self, kernel: str, arg: str, t: Any, n: int | None) -> Exception:
        """The error of a check that failed: the first requirement ``t`` breaks."""
        if not isinstance(t, torch.Tensor):
            return rejected(kernel, arg, "a torch.Tensor", type(t).__name__, self, TypeError)
        if t.dtype not in self.dtypes:
            return rejected(kernel, arg, " or ".join(map(str, self.dtypes)), str(t.dtype), self,
                             TypeError)
        if t.layout is not torch.strided:
            return rejected(kernel, arg, "a strided tensor", f"layout {t.layout}", self)
        if not t.is_cpu:
            return rejected(kernel, arg, "on the CPU", f"device {t.device}", self)
        if not t.is_contiguous():
            return rejected(kernel, arg, "contiguous", _shape(t), self)
        if self.dim is not None and t.dim() != self.dim:
            return rejected(kernel, arg, f"{self.dim}-D", f"shape {tuple(t.shape)}", self)
        if n is not None and t.numel() != n:
            return rejected(kernel, arg, f"of {n} elements", f"{t.numel()} (shape "
                             f"{tuple(t.shape)})", self)
        return rejected(kernel, arg, "non-empty", f"shape {tuple(t.shape)}", self)


def read(dtypes: tuple[torch.dtype, ...], *, optional: bool = False, dim: int | None = None,
         nonempty: bool = False) -> TensorArg:
    """A tensor argument the kernel only reads (``TensorArg``)."""
    return TensorArg(dtypes, writes=False, optional=optional, dim=dim, nonempty=nonempty)


def written(dtypes: tuple[torch.dtype, ...], *, optional: bool = False, dim: int | None = None,
            nonempty: bool = False) -> TensorArg:
    """A tensor argument the kernel writes, and may read (``TensorArg``)."""
    return TensorArg(dtypes, writes=True, optional=optional, dim=dim, nonempty=nonempty)


class RowsArg:
    """A 2-D strided CPU tensor whose rows are each contiguous (unit column stride, any row
    stride: a column slice of a wider tensor, a record's field in a mapped file), passed as the
    address of its data. ``value = (tensor, like)``: ``like`` None, or a tensor whose dtype and
    width it must have."""

    checked = True
    ctype = ctypes.c_void_p

    def __init__(self, dtypes: tuple[torch.dtype, ...] | None, *, writes: bool) -> None:
        self.dtypes, self.writes = dtypes, writes
        dtype = ("" if dtypes is None else
                 "(" + " or ".join(f"t.dtype is {_DTYPE_NAMES[d]}" for d in dtypes) + ") and ")
        self._ok = eval(f"lambda t, like: {dtype}t.layout is _strided and t.is_cpu and "
                        f"t.dim() == 2 and (t.is_contiguous() or t.stride(1) == 1 or "
                        f"t.shape[1] <= 1) and (like is None or (t.dtype is like.dtype and "
                        f"t.shape[1] == like.shape[1]))", dict(_CHECK_SCOPE))

    def __repr__(self) -> str:
        dtypes = "" if self.dtypes is None else "/".join(str(d).removeprefix("torch.")
                                                       for d in self.dtypes) + " "
        return (f"a 2-D CPU {dtypes}tensor with unit column stride (rows of contiguous "
                f"elements, any row stride), {'written' if self.writes else 'read'}")

    def address(self, kernel: str, arg: str, value: tuple[Any, torch.Tensor | None],
                index: int | None = None) -> int:
        """The data's address of ``value = (tensor, like)`` after the checks (``index``: the
        argument is element ``index`` of a list)."""
        t, like = value
        try:
            if self._ok(t, like):
                return t.data_ptr()
        except AttributeError:
            pass
        raise self.failure(kernel, arg if index is None else f"{arg}[{index}]", t, like)

    def failure(self, kernel: str, arg: str, t: Any, like: torch.Tensor | None) -> Exception:
        """The error of a check that failed: the first requirement ``t`` breaks."""
        if not isinstance(t, torch.Tensor):
            return rejected(kernel, arg, "a torch.Tensor", type(t).__name__, self, TypeError)
        if self.dtypes is not None and t.dtype not in self.dtypes:
            return rejected(kernel, arg, " or ".join(map(str, self.dtypes)), str(t.dtype), self,
                             TypeError)
        if like is not None and t.dtype != like.dtype:
            return rejected(kernel, arg, f"{like.dtype} (as the rows it pairs with)",
                             str(t.dtype), self, TypeError)
        if t.layout is not torch.strided:
            return rejected(kernel, arg, "a strided tensor", f"layout {t.layout}", self)
        if not t.is_cpu:
            return rejected(kernel, arg, "on the CPU", f"device {t.device}", self)
        if t.dim() != 2:
            return rejected(kernel, arg, "2-D", f"shape {tuple(t.shape)}", self)
        if t.shape[1] > 1 and t.stride(1) != 1:
            return rejected(kernel, arg, "of unit column stride", _shape(t), self)
        if like is None:  # (not reached: every requirement holds)
            return rejected(kernel, arg, "a tensor the check accepts", _shape(t), self)
        return rejected(kernel, arg, f"{like.shape[1]} columns wide (as the rows it pairs with)",
                         f"shape {tuple(t.shape)}", self)


def read_rows(dtypes: tuple[torch.dtype, ...] | None) -> RowsArg:
    """Rows the kernel only reads (``RowsArg``)."""
    return RowsArg(dtypes, writes=False)


def written_rows(dtypes: tuple[torch.dtype, ...] | None) -> RowsArg:
    """Rows the kernel writes (``RowsArg``)."""
    return RowsArg(dtypes, writes=True)


class PartsArg:
    """The addresses of a list of int64 CPU tensors (``ec_concat_dedup``'s ``parts``), passed as
    a ``const i64* const*``. ``value = (parts, lens, steps)``: part p has ``lens[p]`` elements,
    ``steps[p]`` apart (``steps`` None: contiguous)."""

    checked = True
    ctype = ctypes.POINTER(ctypes.c_void_p)
    _one = read(I64)

    def __repr__(self) -> str:
        return "a list of CPU int64 tensors, each contiguous or one column of a wider one, read"

    def address(self, kernel: str, arg: str, value: tuple[Sequence[torch.Tensor], Sequence[int],
                                                        Sequence[int] | None]) -> Any:
        parts, lens, steps = value
        if len(parts) != len(lens):
            raise rejected(kernel, arg, f"a list of {len(lens)} tensors", f"{len(parts)}", self)
        addresses = []
        for p, (t, n) in enumerate(zip(parts, lens)):
            step = 1 if steps is None else steps[p]
            if step == 1:
                addresses.append(self._one.address(kernel, arg, (t, n), p))
                continue
            try:  # a column: n elements, step apart
                ok = (t.dtype is torch.int64 and t.layout is torch.strided and t.is_cpu
                      and t.numel() == n and (n <= 1 or (t.shape[0] == n and t.stride(0) == step)))
            except AttributeError:
                ok = False
            if not ok:
                raise rejected(kernel, f"{arg}[{p}]", f"{n} int64 CPU elements {step} apart",
                                repr(t) if not isinstance(t, torch.Tensor) else
                                f"{t.dtype} {t.device} {_shape(t)}", self)
            addresses.append(t.data_ptr())
        return ctypes_array(ctypes.c_void_p, len(addresses))(*addresses)


class ArrayArg:
    """A ctypes array the wrapper builds (lengths, offsets, the addresses of a list of tensors,
    a few numbers in and out), passed as a pointer to its first element; None: nullptr."""

    checked = False

    def __init__(self, ctype: Any) -> None:
        self.ctype = ctypes.POINTER(ctype)

    def __repr__(self) -> str:
        return f"an array of {self.ctype._type_.__name__}"


def array(ctype: Any) -> ArrayArg:
    """An array argument the wrapper builds (``ArrayArg``)."""
    return ArrayArg(ctype)


class AllocatedArg:
    """An address inside a buffer the wrapper has just allocated for the kernel's outputs (one
    ``torch.empty`` of the right dtype, split by address arithmetic: a view would cost a
    microsecond each), written by the kernel."""

    checked = False
    ctype = ctypes.c_void_p

    def __init__(self, dtypes: tuple[torch.dtype, ...]) -> None:
        self.dtypes = dtypes

    def __repr__(self) -> str:
        return f"an address in a new {self.dtypes[0]} buffer"


def allocated(dtypes: tuple[torch.dtype, ...]) -> AllocatedArg:
    """An output address inside the wrapper's own buffer (``AllocatedArg``)."""
    return AllocatedArg(dtypes)


class HyperArg:
    """A ``Hyper``, passed by reference as a ``const EcHyper*``."""

    checked = True
    ctype = ctypes.POINTER(Hyper)

    def __repr__(self) -> str:
        return "a kernels.Hyper"

    def address(self, kernel: str, arg: str, value: Any) -> Any:
        if isinstance(value, Hyper):
            return value  # (ctypes passes an instance to a POINTER argument by reference)
        raise rejected(kernel, arg, "a kernels.Hyper", type(value).__name__, self, TypeError)


HYPER = HyperArg()

Kind = Scalar | TensorArg | RowsArg | PartsArg | ArrayArg | AllocatedArg | HyperArg
_KERNELS: list[Kernel] = []  # every declared kernel, bound when the library loads
# library.py's loader: loads the library and binds every kernel; returns None, or why it could not
_LOADER: list[Callable[[], str | None]] = []


def set_loader(load: Callable[[], str | None]) -> None:
    """Registers the library's loader (library.py), which a kernel's first call runs."""
    _LOADER[:] = [load]


def kernels() -> list[Kernel]:
    """Every declared kernel, in declaration order (the loader binds each)."""
    return list(_KERNELS)


class Kernel:
    """One C function of the library: its name, result and arguments ``(name, kind)`` in order.

    ``call(*values)`` takes the arguments in that order (a tensor as ``(tensor, n)``), checks
    each checked one, passes it as its kind says and returns the C function's result; what it was
    given stays referenced until the C function returns (a tensor made inline in the call has no
    other reference). It is
    compiled from the declaration when the library loads (``source``: one function per kernel
    with the tensors' checks written out, as ``dataclasses`` compiles its methods): a generic
    loop over the arguments cost twice the checks themselves, on calls of a few microseconds.
    """

    def __init__(self, name: str, result: Scalar | None,
                 args: Sequence[tuple[str, Kind]], *, packed: bool = False) -> None:
        self.name, self.result, self.args = name, result, tuple(args)
        names = [arg for arg, _ in self.args]
        if len(set(names)) != len(names) or any(not arg.isidentifier() or arg.startswith("_")
                                                for arg in names):
            raise RuntimeError(f"{name}: argument names must be distinct identifiers without a "
                               f"leading underscore, got {names}")
        if packed and any(kind in (DOUBLE, STRING) for _, kind in self.args):
            raise RuntimeError(f"{name}: a packed kernel takes pointers and integers only")
        self.packed = packed  # the library exports ``<name>_packed`` (csrc/packed.h)
        self.source = self._source()
        self._fn: Any = None  # the library's function, once bound
        self._packed_fn: Any = None  # its ``<name>_packed``, once bound (``packed``)
        self.call: Any = self._first_call  # the compiled call once the library has loaded
        _KERNELS.append(self)

    def __repr__(self) -> str:
        args = ", ".join(f"{arg}: {kind!r}" for arg, kind in self.args)
        return f"{self.name}({args}) -> {self.result!r}"

    def _source(self, fixed: Sequence[str] = ()) -> str:
        """The checking call's Python source (``fn``: the library's function; ``fixed``:
        arguments taken from the scope's ``_fixed`` instead, already checked: ``partial``)."""
        names = ", ".join(arg for arg, _ in self.args)
        params = [arg for arg, _ in self.args if arg not in fixed]
        if fixed:  # (keyword-only defaults: read as locals, the cheapest)
            params += ["*", *(f"{arg}=_fixed[{arg!r}]" for arg in fixed)]
        lines = [f"def {self.name}({', '.join(params)}):"]
        given = [arg for arg, kind in self.args if arg not in fixed and kind.checked]
        if given:  # the values as given (a tensor passed inline lives until the kernel returns)
            lines.append(f"    _given = ({', '.join(given)},)")
        for i, (arg, kind) in enumerate(self.args):
            if arg in fixed:
                continue
            if isinstance(kind, TensorArg):  # written out: the hot path
                check = [  # (the temporaries' underscores: no C argument's name has one)
                    f"_t, _n = {arg}",
                    "try:",
                    f"    _ok = {kind.condition('_t', '_n')}",
                    "except AttributeError:",
                    "    _ok = False",
                    "if not _ok:",
                    f"    raise kinds[{i}].failure({self.name!r}, {arg!r}, _t, _n)",
                    f"{arg} = _t.data_ptr()"]
                if kind.optional:
                    check = [f"if {arg}[0] is None:", f"    {arg} = None",
                             "else:", *("    " + line for line in check)]
                lines += ["    " + line for line in check]
            elif kind.checked:
                lines.append(f"    {arg} = kinds[{i}].address({self.name!r}, {arg!r}, {arg})")
        lines += ["    try:",
                  f"        return fn({names})",
                  "    except ArgumentError as e:  # a scalar of the wrong type",
                  "        raise kernel.argument_error(e) from None"]
        return "\n".join(lines)

    def signature(self, lib: ctypes.CDLL) -> Any:
        """The library's function, its ctypes signature set from the declaration."""
        fn = getattr(lib, self.name)
        fn.restype = None if self.result is None else self.result.ctype
        fn.argtypes = [kind.ctype for _, kind in self.args]
        return fn

    def packed_signature(self, lib: ctypes.CDLL) -> Any:
        """The library's ``<name>_packed`` (its arguments in one array of int64 slots), or None
        when the kernel is not ``packed``."""
        if not self.packed:
            return None
        fn = getattr(lib, f"{self.name}_packed")
        fn.restype = None if self.result is None else self.result.ctype
        fn.argtypes = [ctypes.c_void_p]
        return fn

    def bind(self, fn: Any, packed: Any = None) -> None:
        """Compiles ``call`` around the library's function ``fn`` (``packed``: its
        ``<name>_packed``, which ``partial`` then calls)."""
        self._fn, self._packed_fn = fn, packed
        self.call = self._compile(self.source, {})

    def _compile(self, source: str, fixed: dict[str, Any]) -> Any:
        scope = dict(_CHECK_SCOPE, fn=self._fn, kinds=[kind for _, kind in self.args],
                     kernel=self, ArgumentError=ctypes.ArgumentError, _fixed=fixed)
        if "_template" in fixed:  # (``_packed_source``'s)
            scope.update(fixed, fn=self._packed_fn, _addressof=ctypes.addressof,
                         _Array=ctypes.Array)
        exec(compile(source, f"<kernel {self.name}>", "exec"), scope)
        return scope[self.name]

    def partial(self, **fixed: Any) -> Any:
        """``call`` with the arguments ``fixed`` bound once: each checked now, as ``call``
        checks it (a tensor as ``(tensor, n)``), and kept (a tensor stays referenced: its
        address stays valid). Returns a function of the other arguments, in order, that
        checks those at every call: for a kernel called every step with the same table,
        whose checks would otherwise be repeated on every call. A ``packed`` kernel's function
        then passes every argument in one array of slots (``_packed_source``: one ctypes
        conversion instead of one per argument). Loads the library."""
        unknown = sorted(set(fixed) - {arg for arg, _ in self.args})
        if unknown:
            raise TypeError(f"{self.name}: no argument(s) {unknown}; it takes "
                            f"{[arg for arg, _ in self.args]}")
        if self.call == self._first_call:
            self._load()
        values: dict[str, Any] = {}
        for arg, kind in self.args:
            if arg not in fixed:
                continue
            v = fixed[arg]
            if isinstance(kind, TensorArg | RowsArg | PartsArg | HyperArg):
                v = kind.address(self.name, arg, v)  # (a check of each, as ``call``'s)
            values[arg] = v
        values["_kept"] = fixed  # (the tensors behind the addresses)
        bound = [a for a, _ in self.args if a in fixed]
        if self._packed_fn is None:
            return self._compile(self._source(bound), values)
        slots = ctypes_array(ctypes.c_int64, len(self.args))()
        for i, (arg, kind) in enumerate(self.args):
            if arg in values:  # (the fixed slots, written once; the others at every call)
                slots[i] = _slot(kind, values[arg], self, arg)
        return self._compile(self._packed_source(bound), {"_template": slots, "_kept": fixed,
                                                            "_local": threading.local()})

    def _packed_source(self, fixed: Sequence[str]) -> str:
        """``partial``'s call through ``<name>_packed``: the arguments not ``fixed`` checked as
        ``_source`` checks them, then written into this thread's slots (the fixed ones already
        there, copied from ``_template``), and one ctypes argument passed: the slots' address."""
        params = [arg for arg, _ in self.args if arg not in fixed]
        lines = [f"def {self.name}({', '.join(params)}):"]
        given = [arg for arg, kind in self.args if arg not in fixed and kind.checked]
        if given:  # (kept until the kernel returns, as ``_source``'s)
            lines.append(f"    _given = ({', '.join(given)},)")
        lines += ["    try:",  # the slots of this thread (a kernel may run on several)
                  "        _s = _local.s",
                  "    except AttributeError:",
                  "        _s = _local.s = type(_template).from_buffer_copy(_template)"]
        body = self._source(fixed).split("\n")  # the checks, as ``call``'s
        checks = body[2 if given else 1:len(body) - 1 - body[::-1].index("    try:")]
        lines += checks
        for i, (arg, kind) in enumerate(self.args):
            if arg in fixed:
                continue
            if isinstance(kind, TensorArg | RowsArg):  # (an address, or None: optional)
                lines.append(f"    _s[{i}] = {arg} or 0")
            elif isinstance(kind, HyperArg | PartsArg):  # (a PartsArg's new array lives on
                lines.append(f"    _s[{i}] = _addressof({arg})")  # in the local until return)
            elif isinstance(kind, ArrayArg):  # an array of its type, or None (as ctypes checks)
                lines += [f"    if {arg} is None:",
                          f"        _s[{i}] = 0",
                          (f"    elif isinstance({arg}, _Array) and {arg}._type_ is "
                           f"kinds[{i}].ctype._type_:"),
                          f"        _s[{i}] = _addressof({arg})",
                          "    else:",
                          f"        raise kernel.slot_error({i}, {arg})"]
            else:  # a scalar or an address: an integer (None: nullptr for an address)
                value = f"0 if {arg} is None else {arg}" if isinstance(kind, AllocatedArg) else arg
                lines += ["    try:",
                          f"        _s[{i}] = {value}",
                          "    except TypeError:",
                          f"        raise kernel.slot_error({i}, {arg}) from None"]
        lines.append("    return fn(_addressof(_s))")
        return "\n".join(lines)

    def _first_call(self, *values: Any) -> Any:
        self._load()
        return self.call(*values)

    def _load(self) -> None:
        """Loads the library, which binds ``call``; RuntimeError when it cannot."""
        problem = _LOADER[0]() if _LOADER else "no library loader"
        if problem is not None or self.call == self._first_call:
            raise RuntimeError(f"{self.name}: the fused CPU kernels are not available "
                               f"({problem}); callers check cpu.usable() first")

    def slot_error(self, i: int, value: Any) -> TypeError:
        """A value that argument ``i``'s slot cannot hold, as ``argument_error`` names it."""
        arg, kind = self.args[i]
        return TypeError(f"{self.name}: argument {arg!r} must be {kind!r}: wrong type "
                         f"{type(value).__name__}")

    def argument_error(self, e: ctypes.ArgumentError) -> TypeError:
        """ctypes' "argument 3: TypeError: ..." as a TypeError naming the argument."""
        found = re.match(r"argument (\d+): (.*)", str(e))
        if found is None or not 1 <= int(found[1]) <= len(self.args):
            return TypeError(f"{self.name}: {e}")
        arg, kind = self.args[int(found[1]) - 1]
        return TypeError(f"{self.name}: argument {arg!r} must be {kind!r}: {found[2]}")


def _slot(kind: Kind, value: Any, kernel: Kernel, arg: str) -> int:
    """A fixed argument's value (as ``partial`` checked it) as its slot's integer: an address
    (0: nullptr) or a number."""
    if value is None:
        return 0
    if isinstance(kind, HyperArg | PartsArg):
        return ctypes.addressof(value)
    if isinstance(kind, ArrayArg):
        if isinstance(value, ctypes.Array) and value._type_ is kind.ctype._type_:
            return ctypes.addressof(value)
    else:
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise kernel.slot_error([a for a, _ in kernel.args].index(arg), value)


def hyper_layout_errors(lib: ctypes.CDLL, cls: type[ctypes.Structure] = Hyper) -> list[str]:
    """How ``cls`` (``Hyper``) and the library's ``EcHyper`` disagree; empty when they agree.

    Compares the sizes and the field names in order, then writes a distinct value into every
    field of ``cls`` by name and reads each back in C++ by the same name (``ec_hyper_field``
    reads ``offsetof(EcHyper, name)``). Microseconds: done at every load.
    """
    if lib.ec_hyper_size() != ctypes.sizeof(cls):  # nothing more to compare safely
        return [f"size {ctypes.sizeof(cls)} in Python, {lib.ec_hyper_size()} in C++"]
    if any(field[1] is not ctypes.c_double for field in cls._fields_):
        return [f"fields {cls._fields_} in Python, doubles only in C++"]
    errors = []
    names = [field[0] for field in cls._fields_]
    cpp: list[str] = []
    while len(cpp) <= len(names):  # one past the Python side's last: None unless C++ has more
        name = lib.ec_hyper_field_name(len(cpp))
        if name is None:
            break
        cpp.append(name.decode())
    if cpp != names:
        errors.append(f"fields {names} in Python, {cpp} in C++")
    h = cls.from_buffer_copy(bytes(ctypes.sizeof(cls)))  # zeros, without __init__
    for i, name in enumerate(names):
        setattr(h, name, 1.5 + i)
    ptr = ctypes.cast(ctypes.pointer(h), HYPER.ctype)
    for i, name in enumerate(cpp):
        if name in names and lib.ec_hyper_field(ptr, i) != getattr(h, name):
            errors.append(f"field {name!r} does not round-trip")
    return errors


_C = TypeVar("_C", bound="ctypes._SimpleCData[Any]")
_ARRAYS: dict[tuple[type, int], Any] = {}  # {(ctype, n): ctype * n}


def ctypes_array(ctype: type[_C], n: int) -> type[ctypes.Array[_C]]:
    """The ctypes array type ``ctype * n`` (cached: creating one costs microseconds)."""
    key = (ctype, n)
    t = _ARRAYS.get(key)
    if t is None:
        t = _ARRAYS[key] = ctype * n
    return t
