"""Serving without Python embcore: ``ServingModule.compile_package`` writes an AOTInductor
package (``.pt2``) that a process with torch alone loads (``torch._inductor.aoti_load_package``)
and that answers bit for bit as the eager module, at fp32, fp16 and int8, a dynamic table's map
included; the Criteo model's whole package likewise (examples/criteo/serve.py ``--aoti``).

Compiling needs a C++ compiler (as embcore's own kernels do) and takes seconds to a minute: the
tests are marked slow and skip, saying so, without one."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
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


def test_a_layer_package_serves_without_embcore_bit_for_bit(tmp_path):
    served = _layer().for_serving(quantize={"t": "int8", "raw": "fp16"})
    assert served.precisions == {"t": "int8", "u": None, "raw": "fp16"}
    g = torch.Generator().manual_seed(5)
    path = served.compile_package(tmp_path / "pkg" / "lookup.pt2", *_batch(g, 4))
    assert path == tmp_path / "pkg" / "lookup.pt2" and path.is_file()
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
    with pytest.raises(SystemExit):  # (refused with the arguments, before any scoring)
        serve.main(["--run", str(out), "--precisions", "int8", "--aoti",
                    str(tmp_path / "dlrm.so")])
    assert "an AOTInductor package's name ends in .pt2" in capsys.readouterr().err
