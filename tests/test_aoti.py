"""Serving without Python embcore: ``ServingModule.compile_package`` writes an AOTInductor
package (``.pt2``) that a process with torch alone loads (``torch._inductor.aoti_load_package``)
and that answers bit for bit as the eager module, at fp32, fp16 and int8, a dynamic table's map
included; the Criteo model's whole package likewise (examples/criteo/serve.py ``--aoti``).

Compiling needs a C++ compiler (as embcore's own kernels do) and takes seconds to a minute: the
tests are marked slow and skip, saying so, without one."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import embcore as ec

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                       reason="AOTInductor compiles C++: no compiler on this machine"),
]

# The loading process: embcore cannot be imported there (a finder refuses it), only torch.
LOADER = textwrap.dedent("""
    import sys

    class NoEmbcore:
        def find_spec(self, name, path=None, target=None):
            if name == "embcore" or name.startswith("embcore."):
                raise ImportError("this process serves without embcore")
            return None

    sys.meta_path.insert(0, NoEmbcore())
    import torch

    package, inputs, outputs = sys.argv[1:]
    model = torch._inductor.aoti_load_package(package)
    batches = torch.load(inputs, weights_only=True)
    with torch.no_grad():
        answers = [model(*args) for args in batches]
    assert not [m for m in sys.modules if m.split(".")[0] == "embcore"]
    torch.save(answers, outputs)
""")


def serve_elsewhere(package: Path, batches: list[tuple], tmp_path: Path) -> list:
    """``package``'s answers to ``batches`` (argument tuples), from a fresh process without
    embcore."""
    (tmp_path / "loader.py").write_text(LOADER)
    torch.save(batches, tmp_path / "inputs.pt")
    run = subprocess.run([sys.executable, "-I", str(tmp_path / "loader.py"), str(package),
                          str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(tmp_path / "outputs.pt", weights_only=True)


def _layer() -> ec.EmbeddingLayer:
    """Three tables to serve at fp32 (``u``), int8 (``t``) and fp16 (``raw``, dynamic: raw ids,
    its map travels in the package), trained a step so that the rows and the map are not the
    initial ones."""
    torch.manual_seed(3)
    t = ec.TableConfig(vocabulary_size=16, dim=5, combiner="mean", name="t")
    u = ec.TableConfig(vocabulary_size=12, dim=5, combiner="sum", name="u")
    raw = ec.TableConfig(vocabulary_size=8, dim=5, combiner="sqrtn", name="raw",
                         dynamic=ec.DynamicVocabulary())
    fc = {"dense": ec.FeatureConfig(table=t), "bag": ec.FeatureConfig(table=u),
          "seq": ec.FeatureConfig(table=t, max_sequence_length=3),
          "raw": ec.FeatureConfig(table=raw)}
    layer = ec.EmbeddingLayer(fc, ec.Adagrad(learning_rate=0.5))
    seen = torch.tensor([2**60, -4, 9, 77, -(2**40)])
    out = layer({"dense": torch.tensor([1, 2]), "bag": (torch.tensor([3, 4, 5]),
                                                        torch.tensor([0, 1, 3])),
                 "seq": (torch.tensor([6, 7]), torch.tensor([0, 2])),
                 "raw": (seen, torch.tensor([0, 2, 5]))})
    sum(v.sum() for v in out.values()).backward()
    return layer


def _batch(g: torch.Generator, b: int) -> tuple[dict, dict]:
    """(ids, weights) for ``b`` examples: jagged pairs (bags of 0-3 ids), weights on two."""
    pool = torch.tensor([2**60, -4, 9, 77, -(2**40), 12345, -1])  # the last two not resident
    lengths = torch.randint(0, 4, (b,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    w = torch.rand(n, generator=g) + 0.1
    x = {"dense": torch.randint(0, 16, (b,), generator=g),
         "bag": (torch.randint(0, 12, (n,), generator=g), offsets),
         "seq": (torch.randint(0, 16, (n,), generator=g), offsets),
         "raw": (pool[torch.randint(0, len(pool), (n,), generator=g)], offsets)}
    return x, {"dense": None, "bag": (w, offsets), "seq": None, "raw": (w, offsets)}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """``(served, path, stderr)``: the layer's package, compiled once for the module (with an
    inductor config whose trace the package keeps: its metadata), and what compiling printed."""
    served = _layer().for_serving(quantize={"t": "int8", "raw": "fp16"})
    assert served.precisions == {"t": "int8", "u": None, "raw": "fp16"}
    path = tmp_path_factory.mktemp("aoti") / "pkg" / "lookup.pt2"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        got = served.compile_package(path, *_batch(torch.Generator().manual_seed(5), 4),
                                     inductor_configs={"aot_inductor.metadata":
                                                       {"embcore_test": "kept"}})
    assert got == path and path.is_file()
    return served, path, err.getvalue()


@pytest.fixture(scope="module")
def checked(compiled):
    """The package loaded by ``ec.load_package`` (checked calls)."""
    return ec.load_package(compiled[1])


def test_a_layer_package_serves_without_embcore_bit_for_bit(compiled, tmp_path):
    served, path, _ = compiled
    g = torch.Generator().manual_seed(6)
    batches = [_batch(g, b) for b in (4, 9, 1, 2)]
    answers = serve_elsewhere(path, batches, tmp_path)
    with torch.no_grad():
        for args, got in zip(batches, answers):
            want = served(*args)
            assert sorted(got) == sorted(want)
            for k in want:
                assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k]), k


def test_a_package_path_must_end_in_pt2(tmp_path):
    served = _layer().for_serving()
    with pytest.raises(ValueError, match=r"must end in \.pt2"):
        served.compile_package(tmp_path / "lookup.so", *_batch(torch.Generator(), 2))
    assert not list(tmp_path.iterdir())


def _answers_equal(got: dict, want: dict) -> bool:
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_compiling_says_so_and_keeps_its_inductor_configs(compiled):
    _, path, err = compiled
    assert f"embcore: compiling {path} with AOTInductor" in err
    assert f"embcore: compiled {path} in " in err and " bytes)" in err
    # the configs reached AOTInductor's compiler: the package carries the metadata they set
    assert torch._inductor.aoti_load_package(str(path)).get_metadata()["embcore_test"] == "kept"


def test_the_checked_package_answers_as_the_module(compiled, checked):
    served = compiled[0]
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for b in (1, 3, 8):
            x, w = _batch(g, b)
            assert _answers_equal(checked(x, w), served(x, w))
            assert _answers_equal(checked(x, weights=w), served(x, w))
            # a dict's keys in another order: each input is taken by its key
            shuffled = {k: x[k] for k in reversed(list(x))}
            assert _answers_equal(checked(shuffled, w), served(x, w))
    assert "features['dense'] int64 (N0,)" in checked.expects


def _three() -> tuple[dict, dict]:
    """A batch of 3 examples, one id a bag, spelled out."""
    off = torch.tensor([0, 1, 2, 3])
    x = {"dense": torch.tensor([1, 2, 3]), "bag": (torch.tensor([4, 5, 6]), off),
         "seq": (torch.tensor([7, 8, 9]), off), "raw": (torch.tensor([2**60, -4, 9]), off)}
    return x, {"dense": None, "bag": (torch.ones(3), off), "seq": None,
               "raw": (torch.ones(3), off)}


def test_the_raw_package_serves_wrong_rows_that_the_checked_one_refuses(compiled, checked):
    """What AOTInductor's loader serves wrongly (strides ignored, int32 read as int64, a
    (B, 2) input read as (B,), keys taken in the caller's order), refused by name."""
    served, path, _ = compiled
    raw = torch._inductor.aoti_load_package(str(path))
    x, w = _three()
    column = torch.tensor([[1, 9], [2, 9], [3, 9]])[:, 0]  # ids [1, 2, 3], strides (2,)
    int32 = torch.zeros(8, dtype=torch.int32)
    int32[:4] = torch.tensor([5, 0, 7, 0])  # ids [5, 0, 7, 0], zeros past the end
    wrong = {"a column": ({**x, "dense": column}, ValueError,
                          r"feature 'dense': ids .* not contiguous.*\.contiguous\(\)"),
             "int32 ids": ({**x, "dense": int32[:4]}, TypeError,
                           r"'dense': ids .* int64 as traced, got torch\.int32; .*to\(torch.int64"),
             "(B, 2) ids": ({**x, "dense": torch.tensor([[5, 6], [7, 8], [1, 2]])}, ValueError,
                            r"feature 'dense': ids .* int64 \(N0,\) as traced, got shape \(3, 2")}
    with torch.no_grad():
        for what, (bad, error, message) in wrong.items():
            fixed = {**bad, "dense": bad["dense"].contiguous().to(torch.int64)}
            got, want = raw(bad, w)["dense"], served(fixed, w)["dense"]
            assert got.shape != want.shape or not torch.equal(got, want), what
            with pytest.raises(error, match=message):
                checked(bad, w)
        swapped = {k: x[k] for k in ["dense", "seq", "bag", "raw"]}  # bag and seq swap places
        assert not torch.equal(raw(swapped, w)["bag"], served(x, w)["bag"])
        assert _answers_equal(checked(swapped, w), served(x, w))


def test_the_checked_package_refuses_what_it_was_not_traced_for(checked):
    x, w = _batch(torch.Generator().manual_seed(9), 3)
    offsets = x["bag"][1]
    n = int(offsets[-1])
    cases = [
        ({**x, "dense": torch.tensor([1.0, 2.0, 3.0])}, w, TypeError,
         r"feature 'dense': ids .* must be int64 as traced, got torch\.float32"),
        ({**x, "bag": (x["bag"][0], offsets.flip(0))}, w, ValueError,
         r"feature 'bag': offsets .* must run from 0, never decreasing, to the number of values"),
        ({**x, "bag": (x["bag"][0], offsets + 1)}, w, ValueError,
         r"feature 'bag': offsets .*cumsum of the bags' lengths"),
        ({**x, "dense": torch.tensor([1, 16, 2])}, w, ValueError,
         r"feature 'dense': ids .* has id 16 but its table has 16 rows; ids must be in \[0, 16\)"),
        ({**x, "dense": torch.tensor([1, -1, 2])}, w, ValueError, r"has id -1"),
        ({k: v for k, v in x.items() if k != "bag"}, w, ValueError,
         r"features: keys .* differ from the traced keys .* missing \['bag'\]"),
        ({**x, "bag": x["bag"][0]}, w, TypeError,
         r"features\['bag'\] must be a tuple of 2 as traced \(a jagged \(values, offsets"),
        (x, {**w, "dense": torch.ones(3)}, TypeError,
         r"weights\['dense'\]: the package was traced with None there"),
        (x, {**w, "bag": (w["bag"][0], torch.arange(4) * 0)}, ValueError,
         r"feature 'bag': weight offsets .* must equal its ids' offsets"),
        (x, None, TypeError, r"weights must be a dict of keys"),
        ({**x, "raw": (torch.zeros(n + 1, dtype=torch.int64), x["raw"][1])}, w, ValueError,
         rf"feature 'raw': ids .* its size {n + 1} in dim 0 must equal the other inputs' traced "),
    ]
    for features, weights, error, message in cases:
        with pytest.raises(error, match=message):
            checked(features, weights)
    with pytest.raises(TypeError, match=r"3 arguments given; the package takes \(features, "
                                        r"weights\): features\['dense'\] int64 \(N0,\);"):
        checked(x, w, x)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['ids'\]"):
        checked(ids=x)


def test_a_flipped_bit_in_the_package_s_table_is_refused(compiled, tmp_path):
    served, path, _ = compiled
    data = bytearray(path.read_bytes())
    row = served.u[3].numpy().tobytes()  # table 'u' (float32) row 3, as the package holds it
    at = data.find(row)
    assert at >= 0 and data.find(row, at + 1) < 0
    data[at] ^= 1  # the lowest bit of the row's first entry
    damaged = tmp_path / "damaged.pt2"
    damaged.write_bytes(bytes(data))
    x, w = _three()
    x["bag"] = (torch.tensor([3, 3, 3]), x["bag"][1])
    with torch.no_grad():  # torch's loader serves the changed row
        got = torch._inductor.aoti_load_package(str(damaged))(x, w)["bag"]
        assert not torch.equal(got, served(x, w)["bag"])
    with pytest.raises(ValueError, match=r"damaged\.pt2: 1 member\(s\) differ from the checksums "
                                         r"written when it was compiled \(.*\.so\)"):
        ec.load_package(damaged)


def test_load_package_refuses_a_package_without_embcore_s_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match="no package at"):
        ec.load_package(tmp_path / "none.pt2")
    (tmp_path / "text.pt2").write_text("not a zip")
    with pytest.raises(ValueError, match=r"text\.pt2: not a readable package"):
        ec.load_package(tmp_path / "text.pt2")
    with zipfile.ZipFile(tmp_path / "bare.pt2", "w") as z:
        z.writestr("bare/archive_format", "pt2")
    with pytest.raises(ValueError, match=r"bare\.pt2: no extra/embcore_package\.json"):
        ec.load_package(tmp_path / "bare.pt2")


def test_the_criteo_model_packages_whole_and_serves_without_embcore(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from criteo import serve, train
    from test_criteo_serve import TINY
    out = tmp_path / "run"
    train.main(["--synthetic", "--synthetic-lines", "320", "--out", str(out), *TINY])
    path = tmp_path / "dlrm.pt2"
    result = serve.main(["--run", str(out), "--precisions", "int8", "--aoti", str(path),
                         "--export-precision", "int8", "--threads", "1"])
    text = capsys.readouterr().out
    aoti = result["aoti"]
    assert aoti["bitwise_equal"] and aoti["examples_checked"] > 1
    assert "AOTInductor package" in text and "bitwise the eager model's" in text
    assert path.stat().st_size == aoti["bytes"] > 0
    # the package alone, in a process without embcore, against the eager model
    layer, dense_arch, _, state = serve.restore(serve.find_checkpoint(out, None))
    model = serve.ServingDLRM(layer.for_serving(quantize="int8"), dense_arch).eval()
    dataset, _ = serve.load_test_set(state["run"], None, False, tmp_path / "data")
    batches = serve.test_batches(dataset, 50, batches=2)  # 50, 50 and 1 examples
    answers = serve_elsewhere(path, batches, tmp_path)
    with torch.no_grad():
        for (dense, sparse), got in zip(batches, answers):
            assert torch.equal(got, model(dense, sparse))
    # ec.load_package says what the package takes (a first guess: 26 columns, or int32 ids)
    checked = ec.load_package(path)
    dense, sparse = batches[0]
    assert torch.equal(checked(dense, sparse), model(dense, sparse))
    with pytest.raises(TypeError, match=r"27 arguments given; the package takes \(dense, "
                                        r"sparse\): dense float32 \(N0, 13\); sparse int64 "
                                        r"\(N0, 26\)"):
        checked(dense, *sparse.unbind(1))
    with pytest.raises(TypeError, match=r"input sparse must be int64 as traced, got torch\.int32"):
        checked(dense, sparse.int())
    with pytest.raises(ValueError, match=r"input sparse: its size 3 in dim 0 must equal"):
        checked(dense, sparse[:3])
    with pytest.raises(SystemExit):  # (refused with the arguments, before any scoring)
        serve.main(["--run", str(out), "--precisions", "int8", "--aoti",
                    str(tmp_path / "dlrm.so")])
    assert "an AOTInductor package's name ends in .pt2" in capsys.readouterr().err
