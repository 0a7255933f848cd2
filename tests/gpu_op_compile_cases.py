"""The GPU operators (kernels/gpu/ops.py) with compiled kernels, no GPU needed: under AOT
dispatch (``torch.compile``'s) on fake CUDA tensors, ``lookup``, ``row_gradients`` and
``sparse_update`` decompose into their Triton kernels (``wrap_triton``), which a compiler then
sees. Nothing runs: the trace stops at the compiler.

tests/test_gpu_ops.py runs this file in a fresh interpreter without ``TRITON_INTERPRET`` (the
kernels decorated for compiling). Skipped when triton is not installed. Without a GPU, Triton
has no driver to analyse which arguments a kernel writes, so torch assumes every tensor is
(a warning; the GPU's trace is exact).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: the kernels are decorated for the interpreter (run this "
                "file in a fresh interpreter without it)", allow_module_level=True)

from torch._functorch.aot_autograd import aot_function
from torch._subclasses import FakeTensorMode

from embcore.kernels import gpu


class _Traced(Exception):
    """Stops the compilation once the forward graph is captured."""


def test_the_row_operators_decompose_into_their_triton_kernels():
    assert gpu.available() and not gpu.interpreted(), gpu.error()
    gpu.operators()
    inf = float("inf")

    def step(table, acc, ids, offsets, grad, unique, unique_offsets, order, bag_of):
        out = torch.ops.embcore.lookup(table, ids, offsets, None, 3)  # (R, D)
        g = torch.ops.embcore.row_gradients(grad * out, unique_offsets, order, bag_of, None)
        torch.ops.embcore.sparse_update(table, acc, None, unique, g, None, None, None, None,
                                        None, None, 0, 0, 0.1, 1.0, -inf, inf, 0.0, -inf, inf,
                                        2, [], False, False)
        return out

    graphs = []

    def compiler(gm, inputs):
        graphs.append(gm)
        raise _Traced

    with FakeTensorMode():
        def i64(n):
            return torch.empty(n, dtype=torch.int64, device="cuda")
        args = (torch.empty(10, 6, device="cuda"), torch.empty(10, 6, device="cuda"), i64(7),
                i64(4), torch.empty(3, 6, device="cuda"), i64(4), i64(5), i64(7), i64(7))
        with pytest.raises(_Traced):
            aot_function(step, fw_compiler=compiler)(*args)
    (gm,) = graphs
    launches = [n for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    names = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in launches]
    assert names == ["lookup_kernel", "sparse_update_kernel", "sparse_update_kernel"], names
    rules = [n.kwargs["kwargs"].get("RULE", kernel_side_table.get_constant_args(
        n.kwargs["constant_args_idx"]).get("RULE")) for n in launches[1:]]
    assert rules == [0, 2], rules  # the summed gradients, then Adagrad
    assert not [n for n in gm.graph.nodes if str(n.target).startswith("embcore.")]
