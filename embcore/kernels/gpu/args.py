"""The Triton kernels' launches by name and kind: one declaration per kernel, checked at every
launch, as ``kernels/cpu/args.py`` declares the C kernels.

A launch is ``Launch(kernel, [(argument, kind), ...], stand_in=...)`` with every parameter of
the kernel, in its order and with its names (checked when declared, against the kernel's own
signature). The kinds: ``tensor(dtypes)`` (a contiguous tensor of one of the dtypes; ``None``
for any), ``tensor(..., optional=True)`` (or None: the kernel does not read it under the
constexprs of that call), ``INT`` / ``FLOAT`` (a scalar the kernel takes at run time) and
``CONSTEXPR`` (a ``tl.constexpr``: an int or a bool, one compiled variant per value).

``declared(**arguments)`` takes every argument by name (a missing or unknown name is a
TypeError naming the kernel) and returns them, checked, in the kernel's order, for
``kernel[grid](*...)``. An absent
tensor is passed as None, never as a placeholder: the declaration's ``stand_in`` (a read-only
tensor argument the kernel always takes) is handed to Triton in its place (a pointer argument
must be a tensor; the kernel never reads it). The check is compiled from the declaration into one
function per kernel (as ``kernels/cpu/args.py`` does), every check in one condition: a few
microseconds a launch, against a Triton launch's tens (binding ``sparse_update_kernel``'s 45
arguments by name costs more than checking them). A tensor of the wrong dtype or layout, or a
scalar of the wrong type, is a TypeError / ValueError naming the kernel and the argument, raised
before the kernel runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch


class Kind:
    """One argument's kind (``TensorKind``, ``ScalarKind``)."""

    def condition(self, v: str) -> str:
        """The check, as a Python expression over the argument ``v`` (its kind's constants
        read as ``_<v>``)."""
        raise NotImplementedError

    def constant(self) -> Any:
        """What ``condition`` reads as ``_<v>``."""
        raise NotImplementedError

    def failure(self, kernel: str, arg: str, v: Any) -> Exception | None:
        """The error of ``v`` (None where it passes)."""
        raise NotImplementedError


class TensorKind(Kind):
    """A contiguous tensor of one of ``dtypes`` (None: any), passed as a pointer; ``writes``: the
    kernel writes it (and may read it); ``optional``: None is accepted (the stand-in goes)."""

    def __init__(self, dtypes: tuple[torch.dtype, ...] | None, *, writes: bool,
                 optional: bool) -> None:
        self.dtypes, self.writes, self.optional = dtypes, writes, optional

    def __repr__(self) -> str:
        dtypes = ("any" if self.dtypes is None else
                  "/".join(str(d).removeprefix("torch.") for d in self.dtypes))
        return (f"a contiguous {dtypes} tensor{' or None' if self.optional else ''}, "
                f"{'written' if self.writes else 'read'}")

    def condition(self, v: str) -> str:
        dtype = "" if self.dtypes is None else f" and {v}.dtype in _{v}"
        check = f"isinstance({v}, _Tensor){dtype} and {v}.is_contiguous()"
        return f"({v} is None or ({check}))" if self.optional else check

    def constant(self) -> Any:
        return self.dtypes

    def failure(self, kernel: str, arg: str, t: Any) -> Exception | None:
        if t is None and self.optional:
            return None
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{kernel}: argument {arg!r} must be {self!r}, got "
                             f"{type(t).__name__}")
        if self.dtypes is not None and t.dtype not in self.dtypes:
            return TypeError(f"{kernel}: argument {arg!r} must be {self!r}, got {t.dtype}")
        if not t.is_contiguous():
            return ValueError(f"{kernel}: argument {arg!r} must be {self!r}, got shape "
                              f"{tuple(t.shape)} and strides {t.stride()} (not contiguous)")
        return None


class ScalarKind(Kind):
    """A number passed by value: ``types`` the exact Python (or symbolic, under a tracer) types
    it may have (a bool is refused where an int or a float is meant)."""

    def __init__(self, name: str, types: frozenset[type]) -> None:
        self.name, self.types = name, types

    def __repr__(self) -> str:
        return self.name

    def condition(self, v: str) -> str:
        return f"type({v}) in _{v}"

    def constant(self) -> Any:
        return self.types

    def failure(self, kernel: str, arg: str, v: Any) -> Exception | None:
        if type(v) in self.types:
            return None
        return TypeError(f"{kernel}: argument {arg!r} must be {self!r}, got "
                         f"{type(v).__name__} {v!r}")


def tensor(dtypes: tuple[torch.dtype, ...] | None, *, writes: bool = False,
           optional: bool = False) -> TensorKind:
    """A tensor argument (``TensorKind``)."""
    return TensorKind(dtypes, writes=writes, optional=optional)


INT = ScalarKind("an int", frozenset({int, torch.SymInt}))
FLOAT = ScalarKind("a float", frozenset({float, int, torch.SymFloat, torch.SymInt}))
CONSTEXPR = ScalarKind("an int or a bool (a tl.constexpr)", frozenset({int, bool}))

F32, I64, I32, I8 = (torch.float32,), (torch.int64,), (torch.int32,), (torch.int8,)
ROWS = (torch.float32, torch.float16, torch.bfloat16)  # a table's rows: float32 or 16-bit
CODED = ROWS + (torch.uint8,)  # or an 8-bit table's codes (its uint8 view)
BITS = (torch.int8, torch.int16, torch.int32, torch.int64)  # rows moved as integers of a size


def parameters(kernel: Any) -> list[str]:
    """A kernel's parameter names: a compiled or interpreted Triton kernel's ``arg_names``, or
    a plain function's (triton missing)."""
    names = getattr(kernel, "arg_names", None)
    if names is None:
        names = list(inspect.signature(kernel).parameters)
    return list(names)


class Launch:
    """One Triton kernel's arguments by name and kind (see the module's docstring).

    Args:
        kernel: the kernel (``@triton.jit``); its parameters must be the declared names, in order.
        args: ``[(name, kind), ...]``, every parameter of the kernel.
        stand_in: a required read-only tensor argument, passed where an optional tensor is None.

    Raises:
        RuntimeError: the declaration and the kernel disagree (a programming error, raised when
            the kernels load).
    """

    def __init__(self, kernel: Any, args: Sequence[tuple[str, Kind]], *, stand_in: str) -> None:
        self.name = getattr(kernel, "__name__", repr(kernel))
        self.kernel, self.args = kernel, tuple(args)
        names = [arg for arg, _ in self.args]
        if names != parameters(kernel):
            raise RuntimeError(f"{self.name}: declared arguments {names}, the kernel takes "
                               f"{parameters(kernel)}")
        kinds = dict(self.args)
        own = kinds.get(stand_in)
        if not isinstance(own, TensorKind) or own.optional or own.writes:
            raise RuntimeError(f"{self.name}: stand_in {stand_in!r} must be a required tensor "
                               "argument the kernel only reads")
        self.stand_in = stand_in
        self.source = self._source()
        scope: dict[str, Any] = {"_Tensor": torch.Tensor, "_launch": self}
        scope.update({f"_{arg}": kind.constant() for arg, kind in self.args})
        exec(compile(self.source, f"<launch {self.name}>", "exec"), scope)
        self.declared = scope[self.name]

    def __repr__(self) -> str:
        args = ", ".join(f"{arg}: {kind!r}" for arg, kind in self.args)
        return f"{self.name}({args})"

    def _source(self) -> str:
        """The checking function's Python source: keyword-only arguments, every check in one
        condition (the error found by ``failure`` once it fails), the arguments returned in the
        kernel's order."""
        params = [f"{arg}=None" if isinstance(kind, TensorKind) and kind.optional else arg
                  for arg, kind in self.args]
        names = [arg for arg, _ in self.args]
        lines = [f"def {self.name}(*, {', '.join(params)}):",
                 "    if not (" + "\n            and ".join(
                     kind.condition(arg) for arg, kind in self.args) + "):",
                 "        raise _launch.failure({" + ", ".join(f"{a!r}: {a}" for a in names)
                 + "})"]
        lines += [f"    if {arg} is None:\n        {arg} = {self.stand_in}"
                  for arg, kind in self.args if isinstance(kind, TensorKind) and kind.optional]
        lines.append(f"    return ({', '.join(names)},)")
        return "\n".join(lines)

    def failure(self, values: dict[str, Any]) -> Exception:
        """The error of the first argument of ``values`` its kind refuses."""
        for arg, kind in self.args:
            error = kind.failure(self.name, arg, values[arg])
            if error is not None:
                return error
        return RuntimeError(f"{self.name}: a check failed and no argument is refused")
