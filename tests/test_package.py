"""``ec.load_package``'s checks and checksums without a compiler (serving/package.py): the record
of a serving module's exported program, a ``ServingPackage`` over it with a stand-in for the
compiled package (it returns the tensors it is given), and the checksums of a zip archive.
tests/test_aoti.py runs the same checks on compiled packages (it needs a C++ compiler)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

import embcore as ec
from embcore.serving.package import (
    MANIFEST,
    ServingPackage,
    describe_program,
    read_manifest,
    write_manifest,
)


@pytest.fixture(scope="module")
def package() -> ServingPackage:
    """A two-feature serving module's record (dense ids ``a`` of a 10-row table, a jagged
    ``b`` of a dynamic one), the stand-in package returning its inputs."""
    t = ec.TableConfig(vocabulary_size=10, dim=2, combiner="sum", name="t")
    raw = ec.TableConfig(vocabulary_size=8, dim=2, name="raw", dynamic=ec.DynamicVocabulary())
    fc = {"a": ec.FeatureConfig(table=t), "b": ec.FeatureConfig(table=raw)}
    served = ec.EmbeddingLayer(fc, "sgd").for_serving()
    example = {"a": torch.tensor([1, 2, 3, 4]),
               "b": (torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 2, 5]))}
    spec = describe_program(served.export(example), served._roles(example, None))
    return ServingPackage(Path("lookup.pt2"), spec, lambda *leaves: leaves, True)


def test_the_record_names_each_input_s_feature_and_role(package):
    inputs = package.manifest["inputs"]
    assert [(i["name"], i["role"], i["feature"], i["rows"], i["dtype"], len(i["shape"]))
            for i in inputs] == [("features['a']", "ids", "a", 10, "int64", 1),
                                 ("features['b'][0]", "ids", "b", None, "int64", 1),
                                 ("features['b'][1]", "offsets", "b", None, "int64", 1)]
    assert package.expects.startswith("(features): features['a'] int64 (N0,); ")


def test_a_call_passes_the_inputs_in_the_traced_order(package):
    a, values, offsets = torch.tensor([3]), torch.tensor([-5, 2**40]), torch.tensor([0, 0, 2])
    for features in ({"a": a, "b": (values, offsets)}, {"b": [values, offsets], "a": a}):
        got = package(features)
        assert len(got) == 3 and got[0] is a and got[1] is values and got[2] is offsets
    assert package(features=features)[0] is a
    assert package(features, None)[0] is a  # (weights traced as absent, given as None)


@pytest.mark.parametrize("case", [
    ("a column", {"a": torch.tensor([[1, 9], [2, 9]])[:, 0]}, ValueError,
     r"feature 'a': ids \(features\['a'\]\) is not contiguous .*pass \.contiguous\(\)"),
    ("int32", {"a": torch.tensor([5, 0], dtype=torch.int32)}, TypeError,
     (r"feature 'a': ids .* must be int64 as traced, got torch\.int32; convert it with "
      r"\.to\(torch\.int64\)")),
    ("float", {"a": torch.tensor([1.0])}, TypeError, r"must be int64 as traced, got torch\.float"),
    ("(B, 2)", {"a": torch.tensor([[5, 6]])}, ValueError,
     r"feature 'a': ids .* must be int64 \(N0,\) as traced, got shape \(1, 2\)"),
    ("id 10", {"a": torch.tensor([1, 10])}, ValueError,
     r"feature 'a': ids .* has id 10 but its table has 10 rows; ids must be in \[0, 10\)"),
    ("decreasing offsets", {"b": (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3]))},
     ValueError, r"feature 'b': offsets .* never decreasing.*got \[0, 2, 1, 3\]"),
    ("offsets past the ids", {"b": (torch.tensor([1, 2]), torch.tensor([0, 3]))}, ValueError,
     r"to the number of values \(2\); got \[0, 3\]"),
    ("a bare tensor for a jagged pair", {"b": torch.tensor([1, 2])}, TypeError,
     r"features\['b'\] must be a tuple of 2 as traced \(a jagged \(values, offsets\) pair\)"),
    ("nested", {"b": torch.nested.nested_tensor([torch.tensor([1]), torch.tensor([2, 3])],
                                                layout=torch.jagged)}, TypeError,
     r"features\['b'\] must be a tuple of 2"),
], ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_a_call_refuses_what_was_not_traced(package, case):
    _, change, error, message = case
    features = {"a": torch.tensor([1, 2]), "b": (torch.tensor([3, 4]), torch.tensor([0, 1, 2])),
                **change}
    with pytest.raises(error, match=message):
        package(features)


def test_a_call_refuses_other_arguments(package):
    ok = {"a": torch.tensor([1]), "b": (torch.tensor([3]), torch.tensor([0, 1]))}
    with pytest.raises(ValueError, match=r"features: keys \['a'\] differ from the traced keys "
                                         r"\['a', 'b'\]: missing \['b'\]"):
        package({"a": ok["a"]})
    with pytest.raises(TypeError, match=r"3 arguments given; the package takes \(features\): "
                                        r"features\['a'\] int64 \(N0,\)"):
        package(ok, None, ok)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['weights'\]; the package "
                                        r"takes \(features\)"):
        package(ok, weights={"a": None, "b": None})


# ------------------------------------------------------------------------------ checksums
def _archive(path: Path, library: bytes) -> None:
    """A zip laid out as a package (its members under one folder), members stored."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("lookup/archive_format", "pt2")
        z.writestr("lookup/data/aotinductor/model/x.wrapper.so", library)


SPEC = {"arguments": ["x"], "structure": [0], "symbols": {},
        "inputs": [{"name": "x", "dtype": "float32", "shape": [3], "device": "cpu"}]}


def test_a_changed_member_is_refused(tmp_path):
    library = bytes(range(256)) * 8
    good = tmp_path / "lookup.pt2"
    _archive(good, library)
    write_manifest(good, SPEC)
    assert read_manifest(good)["inputs"] == SPEC["inputs"]
    # one bit flipped in the member's bytes (its CRC-32 no longer matches)
    data = bytearray(good.read_bytes())
    data[data.find(library) + 1000] ^= 4
    flipped = tmp_path / "flipped.pt2"
    flipped.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"flipped\.pt2: 1 member\(s\) differ from the checksums "
                                         r"written when it was compiled \(lookup/data/"):
        read_manifest(flipped)
    # the member rewritten whole (a consistent CRC-32), the old record kept
    swapped = tmp_path / "swapped.pt2"
    _archive(swapped, library[::-1])
    with zipfile.ZipFile(good) as z, zipfile.ZipFile(swapped, "a") as out:
        out.writestr("lookup/" + MANIFEST, z.read("lookup/" + MANIFEST))
    with pytest.raises(ValueError, match=r"swapped\.pt2: 1 member\(s\) differ"):
        read_manifest(swapped)


def test_a_damaged_or_missing_record_is_refused(tmp_path):
    path = tmp_path / "lookup.pt2"
    _archive(path, b"library")
    with pytest.raises(ValueError, match=r"no extra/embcore_package\.json in the package: it "
                                         r"was not written by embcore"):
        read_manifest(path)
    write_manifest(path, SPEC)
    with zipfile.ZipFile(path) as z:
        record = json.loads(z.read("lookup/" + MANIFEST))
    record["inputs"][0]["dtype"] = "int64"
    edited = tmp_path / "edited.pt2"
    _archive(edited, b"library")
    with zipfile.ZipFile(edited, "a") as z:
        z.writestr("lookup/" + MANIFEST, json.dumps(record))
    with pytest.raises(ValueError, match=r"edited\.pt2: its manifest .* is damaged"):
        read_manifest(edited)
    with pytest.raises(FileNotFoundError):
        ec.load_package(tmp_path / "absent.pt2")
