"""The device map's and the device cache's Triton kernels compile for an H100 (sm_90), no GPU
needed: Triton's interpreter runs a kernel's Python, not its compilation, and has let through
errors that only the compiler sees (benchmarks/RESULTS.md, GPU). Each kernel is compiled to a
cubin (Triton's bundled ptxas) with the argument types its wrapper in kernels/gpu/launch.py passes.

tests/test_triton.py runs this file in a fresh interpreter without ``TRITON_INTERPRET`` (the
kernels must be decorated for compiling). Skipped when triton is not installed, or where this
Triton cannot compile for CUDA here.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install -e '.[gpu-test]')", allow_module_level=True)

import os  # noqa: E402

import triton  # noqa: E402

from embcore.kernels.gpu import index as triton_hash, init as triton_init, move as triton_move  # noqa: E402,E501

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: the kernels are decorated for the interpreter (run this "
                "file in a fresh interpreter without it)", allow_module_level=True)

HASH = {"keys_ptr": "*i64", "places_ptr": "*i64", "take_ptr": "*i8", "n": "i32",
        "maps_ptr": "*i64", "which_ptr": "*i32"}
CONSTS = ("BLOCK", "ONE", "SLOT64")
CASES = [
    (triton_hash.hash_find_kernel, {"keys_ptr": "*i64", "n": "i32", "maps_ptr": "*i64",
                                    "which_ptr": "*i32", "out_ptr": "*i64"}),
    (triton_hash.hash_insert_kernel, HASH),
    (triton_hash.hash_delete_kernel, HASH),
]


def _compile(fn, signature, constexprs):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32))
    except (ImportError, FileNotFoundError, RuntimeError) as e:
        if "ptxas" in str(e) or isinstance(e, (ImportError, FileNotFoundError)):
            pytest.skip(f"this Triton cannot compile for CUDA here: {e}")
        raise


@pytest.mark.parametrize("one", [True, False], ids=["one index", "several"])
@pytest.mark.parametrize("slot64", [False, True], ids=["int32 slots", "int64 slots"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0].__name__ for c in CASES])
def test_the_hash_kernels_compile_for_sm90(case, slot64, one):
    fn, signature = CASES[case]
    consts = {"BLOCK": 128, "ONE": one, "SLOT64": slot64}
    compiled = _compile(fn, {**signature, **dict.fromkeys(CONSTS, "constexpr")}, consts)
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("dtype", ["i16", "i32", "i64"])
def test_the_row_mover_compiles_for_sm90(dtype):
    signature = {"src_ptr": f"*{dtype}", "src_idx_ptr": "*i64", "dst_ptr": f"*{dtype}",
                 "dst_idx_ptr": "*i64", "take_ptr": "*i8", "n": "i32", "D": "i32",
                 "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"}
    compiled = _compile(triton_move.move_rows_kernel, signature, {"BLOCK_R": 16, "BLOCK_D": 128})
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("seed", ["i32", "i64"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "i16"])
def test_the_new_rows_initializer_compiles_for_sm90_without_fused_multiply_adds(dtype, seed):
    """``init_rows_kernel`` (a bfloat16 table passed as i16), its seed an i32 or an i64 (as
    Triton types an int argument), compiled as the launch does: no product and sum fused (each
    operation rounds as torch's: the CPU's values bit for bit; libdevice's float64 log, within an
    ulp of the CPU's, is the one operation that may differ, seen only where a value lies within
    that of a float32 rounding boundary)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = {"ids_ptr": "*i64", "rows_ptr": "*i64", "take_ptr": "*i8", "n": "i32",
                 "out_ptr": f"*{dtype}", "stride": "i32", "C": "i32", "col0": "i32",
                 "seed": seed, "k_ptr": "*fp64", "BF16": "constexpr", "BLOCK_N": "constexpr",
                 "BLOCK_D": "constexpr"}
    source = ASTSource(fn=triton_init.init_rows_kernel, signature=signature,
                       constexprs={"BF16": dtype == "i16", "BLOCK_N": 16, "BLOCK_D": 128})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"enable_fp_fusion": False})
    except (ImportError, FileNotFoundError, RuntimeError) as e:
        if "ptxas" in str(e) or isinstance(e, (ImportError, FileNotFoundError)):
            pytest.skip(f"this Triton cannot compile for CUDA here: {e}")
        raise
    assert compiled.asm["cubin"]
    ptx = compiled.asm["ptx"]  # products and sums rounded each (".rn": ptxas fuses none of
    assert "mul.rn.f64" in ptx and "add.rn.f64" in ptx  # them; the fused ones left are inside
    assert "\tmul.f64" not in ptx and "\tadd.f64" not in ptx  # libdevice's log)


@pytest.mark.parametrize("bags", [True, False], ids=["with the bags", "without"])
def test_the_batch_kernel_of_a_tables_bags_compiles_for_sm90(bags):
    """``concat_bags_kernel`` (kernels/gpu/batch.py) takes its parts as tuples of pointers and
    sizes, as ``embcore::concat_bags`` launches it (two parts here)."""
    from embcore.kernels.gpu import batch as triton_batch
    two = ("*i64", "*i64")
    sizes = ("i64", "i64")
    signature = {"ids": two, "adds": sizes, "offsets": two, "counts": sizes, "rows": sizes,
                 "shifts": ("i64", "i64", "i64"), "scales": ("*fp32", "*fp32"),
                 "out_ids": "*i64", "out_offsets": "*i64", "out_scales": "*fp32",
                 "out_bags": "*i64", "total": "i64", "N": "constexpr", "BAGS": "constexpr",
                 "LOG": "constexpr", "BLOCK": "constexpr"}
    compiled = _compile(triton_batch.concat_bags_kernel, signature,
                        {"N": 2, "BAGS": bags, "LOG": 4, "BLOCK": 1024})
    assert compiled.asm["cubin"]


ROW_CASES = [(0, False), (2, True), (3, False), (3, True), (4, False), (4, True)]
ROW_POINTERS = {0: "*fp32", 2: "*bf16", 3: "*u8", 4: "*u8"}


@pytest.mark.parametrize(("rows", "stochastic"), ROW_CASES,
                         ids=["float32", "bfloat16 stochastic", "float8_e4m3fn nearest",
                              "float8_e4m3fn stochastic", "float8_e5m2 nearest",
                              "float8_e5m2 stochastic"])
def test_the_row_kernels_compile_for_sm90(rows, stochastic):
    """The lookup and the sparse update (kernels/gpu/rows.py) compile, every rule of the update:
    8-bit rows (ROWS 3, 4: uint8 codes, float32 row scales) and, beside them, float32 and
    bfloat16 rows."""
    from embcore.kernels.gpu import rows as triton_rows
    table = ROW_POINTERS[rows]
    lookup = {"table_ptr": table, "rs_ptr": "*fp32", "ids_ptr": "*i64", "offsets_ptr": "*i64",
              "scales_ptr": "*fp32", "skip_ptr": "*i64", "out_ptr": "*fp32", "R": "i32",
              "D": "i32"}
    consts = {"UNIT": False, "SCALED": True, "CHECKED": True, "ROWS": rows, "BLOCK_R": 16,
              "BLOCK_D": 128}
    compiled = _compile(triton_rows.lookup_kernel,
                        {**lookup, **dict.fromkeys(consts, "constexpr")}, consts)
    assert compiled.asm["cubin"]
    update = {"w_ptr": table, "s1_ptr": "*fp32", "s2_ptr": "*fp32", "rs_ptr": "*fp32",
              "rows_ptr": "*i64", "U": "i32", "D": "i32", "grad_ptr": "*fp32",
              "uoff_ptr": "*i64", "order_ptr": "*i64", "bags_ptr": "*i64",
              "scales_ptr": "*fp32", "skip_ptr": "*i64", "out_ptr": "*fp32",
              "keyrows_ptr": "*i64", "n_keys": "i32", "seg_ptr": "*i64", "nseg": "i32",
              "step_key": "i64", "col0": "i32"}
    update.update(dict.fromkeys(["lr", "gmul", "clip_lo", "clip_hi", "wd", "wmin", "wmax",
                                 "h1", "h2", "h3", "h4", "h5"], "fp32"))
    for rule in range(1, 7):
        consts = {"RULE": rule, "F1": False, "F2": False, "DIRECT": False, "UNIT": False,
                  "SCALED": True, "MULTIPLIED": True, "CLIPPED": True, "DECAYED": True,
                  "BOUNDED": True, "ROWS": rows, "STOCHASTIC": stochastic, "KEYED": True,
                  "CHECKED": True, "BLOCK_U": 16, "BLOCK_D": 128}
        compiled = _compile(triton_rows.sparse_update_kernel,
                            {**update, **dict.fromkeys(consts, "constexpr")}, consts)
        assert compiled.asm["cubin"]
