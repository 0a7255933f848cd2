"""The GPU kernels' launches declared by name (kernels/gpu/args.py), and their torch operators
(kernels/gpu/ops.py): tests/gpu_op_cases.py (run in a fresh interpreter under Triton's
interpreter without a GPU, as tests/test_triton.py runs its cases) and
tests/gpu_op_compile_cases.py (the compiled kernels traced, in a fresh interpreter without it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checks import check_fresh_run

from embcore.kernels.gpu.args import CONSTEXPR, F32, FLOAT, I64, INT, Launch, tensor

CASES = Path(__file__).with_name("gpu_op_cases.py")  # the operators, run
COMPILE_CASES = Path(__file__).with_name("gpu_op_compile_cases.py")  # traced, no GPU


def kernel(x_ptr, y_ptr, w_ptr, n, scale, FLAG):
    """A kernel's parameters (a plain function stands for one: ``Launch`` reads its names)."""


def declared():
    return Launch(kernel, [("x_ptr", tensor(F32)), ("y_ptr", tensor(I64, optional=True)),
                           ("w_ptr", tensor(F32, writes=True)), ("n", INT), ("scale", FLOAT),
                           ("FLAG", CONSTEXPR)], stand_in="x_ptr")


def test_a_launch_names_every_argument_and_an_absent_tensor_gets_the_stand_in():
    x, w = torch.zeros(3), torch.zeros(3)
    got = declared().declared(x_ptr=x, y_ptr=None, w_ptr=w, n=3, scale=0.5, FLAG=True)
    assert got == (x, x, w, 3, 0.5, True)  # (the kernel's order; y_ptr absent: x stands in)
    assert got[1] is x and got[2] is w
    y = torch.zeros(2, dtype=torch.int64)
    assert declared().declared(x_ptr=x, w_ptr=w, n=3, scale=1, FLAG=0)[1] is x
    assert declared().declared(x_ptr=x, y_ptr=y, w_ptr=w, n=3, scale=1, FLAG=0)[1] is y
    assert declared().declared(FLAG=0, scale=1, n=3, w_ptr=w, y_ptr=y, x_ptr=x)[1] is y


def test_a_launch_refuses_a_wrong_argument_naming_the_kernel_and_the_argument():
    x, w = torch.zeros(3), torch.zeros(3)
    launch = declared()
    ok = {"x_ptr": x, "w_ptr": w, "n": 3, "scale": 0.5, "FLAG": True}
    with pytest.raises(TypeError, match=r"kernel.*'n'"):  # missing
        launch.declared(**{k: v for k, v in ok.items() if k != "n"})
    with pytest.raises(TypeError, match=r"kernel.*'m'"):  # unknown
        launch.declared(**ok, m=1)
    with pytest.raises(TypeError, match=r"kernel: argument 'w_ptr' must be .*float32.*int64"):
        launch.declared(**{**ok, "w_ptr": w.long()})
    with pytest.raises(ValueError, match=r"kernel: argument 'x_ptr' .*not contiguous"):
        launch.declared(**{**ok, "x_ptr": torch.zeros(3, 2)[:, 0]})
    with pytest.raises(TypeError, match=r"kernel: argument 'x_ptr' .*got NoneType"):
        launch.declared(**{**ok, "x_ptr": None})
    with pytest.raises(TypeError, match="kernel: argument 'n' must be an int, got bool"):
        launch.declared(**{**ok, "n": True})
    with pytest.raises(TypeError, match="kernel: argument 'scale' must be a float, got str"):
        launch.declared(**{**ok, "scale": "0.5"})
    with pytest.raises(TypeError, match="'FLAG' must be an int or a bool"):
        launch.declared(**{**ok, "FLAG": 1.0})
    with pytest.raises(TypeError, match=r"kernel: argument 'y_ptr' .*got torch.float32"):
        launch.declared(**ok, y_ptr=torch.zeros(2))


def test_a_declaration_must_match_its_kernel():
    with pytest.raises(RuntimeError, match=r"declared arguments .* the kernel takes"):
        Launch(kernel, [("x_ptr", tensor(F32)), ("n", INT)], stand_in="x_ptr")
    args = [("x_ptr", tensor(F32)), ("y_ptr", tensor(I64, optional=True)),
            ("w_ptr", tensor(F32, writes=True)), ("n", INT), ("scale", FLOAT),
            ("FLAG", CONSTEXPR)]
    for bad in ("y_ptr", "w_ptr", "n"):  # optional, written, not a tensor
        with pytest.raises(RuntimeError, match="stand_in"):
            Launch(kernel, args, stand_in=bad)


def test_the_kernels_launches_are_declared_against_their_kernels():
    """Each Triton kernel's declaration (kernels/gpu/ops.py) names its parameters, in order;
    checked against the plain functions when triton is missing."""
    from embcore.kernels.gpu import index, move, ops, rows
    launches = {ops.LOOKUP: rows.lookup_kernel, ops.SPARSE_UPDATE: rows.sparse_update_kernel,
                ops.MOVE_ROWS: move.move_rows_kernel, ops.HASH_FIND: index.hash_find_kernel,
                ops.HASH_INSERT: index.hash_insert_kernel,
                ops.HASH_DELETE: index.hash_delete_kernel}
    for launch, k in launches.items():
        assert launch.kernel is k
        assert [a for a, _ in launch.args] == list(getattr(k, "arg_names", None) or
                                                   k.__code__.co_varnames[:k.__code__.co_argcount])


def _fresh_run(path: Path, interpret: bool, pytestconfig) -> None:
    """Runs the cases of ``path`` in a fresh interpreter, with or without ``TRITON_INTERPRET``
    (which triton reads when a kernel is decorated: it cannot change in a process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    profile = pytestconfig.getoption("--hypothesis-profile")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rs",
                           "-p", "no:cacheprovider", "-p", "no:warnings",
                           *(["--hypothesis-profile", profile] if profile else []),
                           str(path)], capture_output=True, text=True, env=env,
                          cwd=path.parents[1], timeout=900)
    check_fresh_run(proc)


if importlib.util.find_spec("triton") is None:
    pass  # (the operators need triton)
elif torch.cuda.is_available():
    from gpu_op_cases import *  # noqa: F403  (compiled, on the GPU)
else:
    @pytest.mark.slow
    def test_the_operators_under_the_interpreter(pytestconfig):
        _fresh_run(CASES, True, pytestconfig)


@pytest.mark.slow
def test_the_operators_decompose_into_their_kernels_without_a_gpu(pytestconfig):
    """tests/gpu_op_compile_cases.py: compiled kernels traced under AOT dispatch."""
    _fresh_run(COMPILE_CASES, False, pytestconfig)
