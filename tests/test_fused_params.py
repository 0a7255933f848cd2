"""TorchRec's / FBGEMM's ``fused_params`` as embcore optimizers (config/fused_params.py), and
``embcore.torchrec`` without torchrec: neither needs torchrec installed (tests/test_torchrec.py
checks the modules and the updates against TorchRec's and FBGEMM's own)."""

from __future__ import annotations

import enum
import importlib
import sys
from pathlib import Path

import pytest
import torch

import embcore as ec
from embcore.config.fused_params import from_fused_params, optimizer_name


class EmbOptimType(enum.Enum):
    """fbgemm_gpu.split_embedding_configs.EmbOptimType's members used here (the same values)."""
    EXACT_SGD = "exact_sgd"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    ROWWISE_ADAGRAD = "row_wise_adagrad"
    ADAM = "adam"
    LAMB = "lamb"


@pytest.mark.parametrize("given", [EmbOptimType.EXACT_ROWWISE_ADAGRAD, "EXACT_ROWWISE_ADAGRAD",
                                   "exact_row_wise_adagrad"])
def test_an_optimizer_is_its_enum_member_name_or_value(given):
    assert optimizer_name(given) == "exact_row_wise_adagrad"


def test_each_supported_optimizer_becomes_the_embcore_optimizer_with_its_math():
    sgd = from_fused_params({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5})
    assert type(sgd) is ec.SGD and sgd.learning_rate == 0.5
    assert type(from_fused_params({"optimizer": "sgd"})) is ec.SGD
    for member, cls in ((EmbOptimType.EXACT_ADAGRAD, ec.Adagrad),
                        (EmbOptimType.EXACT_ROWWISE_ADAGRAD, ec.RowwiseAdagrad)):
        opt = from_fused_params({"optimizer": member, "learning_rate": 0.05, "eps": 1e-8,
                                 "weight_decay": 0.0, "gradient_clipping": False,
                                 "stochastic_rounding": True, "cache_load_factor": 0.2})
        assert type(opt) is cls  # FBGEMM's accumulators start at 0
        assert (opt.learning_rate, opt.initial_accumulator_value) == (0.05, 0.0)
    default = from_fused_params({})  # FBGEMM's defaults: EXACT_SGD at 0.01
    assert type(default) is ec.SGD and default.learning_rate == 0.01


def test_stochastic_rounding_is_fbgemms_default_true_unless_given():
    from embcore.config.fused_params import stochastic_rounding
    assert stochastic_rounding({}) is True  # FBGEMM's default (tests/test_torchrec.py reads it)
    assert stochastic_rounding({"stochastic_rounding": False}) is False
    assert stochastic_rounding({"optimizer": "exact_sgd", "stochastic_rounding": True}) is True
    for bad in ("False", 0, None):
        with pytest.raises(TypeError, match="must be a bool"):
            stochastic_rounding({"stochastic_rounding": bad})


@pytest.mark.parametrize("params, error, message", [
    ({"optimizer": EmbOptimType.ADAM}, ValueError, r"'adam' is not supported.*ec\.Adam"),
    ({"optimizer": EmbOptimType.LAMB}, ValueError, r"'lamb' is not supported.*no optimizer"),
    ({"optimizer": EmbOptimType.ROWWISE_ADAGRAD}, ValueError, r"EXACT_ROWWISE_ADAGRAD"),
    ({"optimizer": "exact_sgd", "lr": 0.1}, ValueError, r"unknown or unsupported keys \['lr'\]"),
    ({"optimizer": "exact_adagrad", "weight_decay": 0.1}, ValueError, r"weight_decay=0\.1"),
    ({"optimizer": "exact_sgd", "weight_decay": -0.1}, ValueError,
     r"weight_decay=-0\.1 is negative"),
    ({"optimizer": "exact_sgd", "weight_decay": float("nan")}, ValueError,
     r"weight_decay=nan is negative \(or NaN\)"),
    ({"stochastic_rounding": "False"}, TypeError,
     r"\['stochastic_rounding'\] must be a bool, got str 'False'"),
    ({"optimizer": "exact_adagrad", "gradient_clipping": True}, ValueError, r"clipvalue"),
    ({"optimizer": 3}, TypeError, r"EmbOptimType or its name, got int"),
    ({"learning_rate": "0.1"}, TypeError, r"\['learning_rate'\] must be a real number"),
    ({"learning_rate": -1.0}, ValueError, r"learning_rate"),
    ([("optimizer", "sgd")], TypeError, r"fused_params must be a dict"),
])
def test_what_embcore_cannot_reproduce_is_refused_saying_why(params, error, message):
    with pytest.raises(error, match=message):
        from_fused_params(params)


def test_without_torchrec_the_import_names_the_extra(monkeypatch):
    for name in ["torchrec"] + [m for m in sys.modules if m.startswith("torchrec.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.delitem(sys.modules, "embcore.torchrec", raising=False)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[torchrec\]'") as raised:
        importlib.import_module("embcore.torchrec")
    message = str(raised.value)
    # commands that work: embcore is not on the package index, so no `pip install embcore[...]`
    assert "pip install embcore[" not in message
    assert "pip install -e '.[torchrec]' ./packaging/fbgemm-gpu-cpu" in message  # without CUDA
    assert (Path(__file__).parents[1] / "packaging" / "fbgemm-gpu-cpu" / "pyproject.toml").is_file()
    assert "embcore-<version>-py3-none-any.whl[torchrec]" in message  # from a built wheel


class _BrokenFbgemm:
    """A meta path finder as torchrec's import fails with fbgemm-gpu's CUDA build and no CUDA."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchrec" or name.startswith("torchrec."):
            raise OSError("Could not load this library: .../fbgemm_gpu/fbgemm_gpu_config.so")
        return None


def test_a_torchrec_whose_fbgemm_does_not_load_names_the_cpu_build(monkeypatch):
    for name in [m for m in sys.modules if m == "torchrec" or m.startswith("torchrec.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "embcore.torchrec", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenFbgemm(), *sys.meta_path])
    with pytest.raises(ImportError, match=r"fbgemm_gpu_config\.so.*fbgemm-gpu-cpu") as raised:
        importlib.import_module("embcore.torchrec")
    message = str(raised.value)
    # FBGEMM built for another torch fails the same way: the message names both, and the match
    assert f"on torch {torch.__version__}" in message and "1.8 for torch 2.13" in message
    assert "./packaging/fbgemm-gpu-cpu" in message and "--force-reinstall" not in message
