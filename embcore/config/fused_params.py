"""TorchRec's ``fused_params`` (FBGEMM's table-batched embedding arguments) as an embcore optimizer.

TorchRec users choose the optimizer their embedding kernels apply inside the backward pass with a
dict such as ``{"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01, "eps":
1e-8}`` (FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` arguments). ``from_fused_params``
turns it into the embcore optimizer with the same math (docs/semantics.md section 15), or
refuses it saying why. torchrec and fbgemm_gpu are not needed: ``optimizer`` may be FBGEMM's
``EmbOptimType`` or its name or value as a string.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from .optimizers import SGD, Adagrad, Optimizer, RowwiseAdagrad

# FBGEMM's defaults (SplitTableBatchedEmbeddingBagsCodegen): EXACT_SGD at 0.01, eps 1e-8,
# stochastic rounding of FP16 / BF16 tables.
DEFAULT_OPTIMIZER = "exact_sgd"
DEFAULT_LEARNING_RATE = 0.01
DEFAULT_EPS = 1e-8
DEFAULT_STOCHASTIC_ROUNDING = True

# EmbOptimType values embcore runs with the same math (FBGEMM's accumulators start at 0),
# as functions of the learning rate.
_RULES: dict[str, Callable[[float], Optimizer]] = {
    "exact_sgd": lambda lr: SGD(learning_rate=lr),
    "sgd": lambda lr: SGD(learning_rate=lr),  # non-deterministic in FBGEMM: the same sum
    "exact_adagrad": lambda lr: Adagrad(learning_rate=lr, initial_accumulator_value=0.0),
    "exact_row_wise_adagrad": lambda lr: RowwiseAdagrad(learning_rate=lr,
                                                        initial_accumulator_value=0.0),
}
_WHY_NOT: dict[str, str] = {
    "row_wise_adagrad": "FBGEMM's approximate row-wise Adagrad updates a row once per occurrence; "
                        "use EmbOptimType.EXACT_ROWWISE_ADAGRAD (each touched row once, on the "
                        "summed gradient)",
    "adam": "FBGEMM's Adam corrects its bias with a step count per table; pass "
            "optimizer=ec.Adam(...) (a callable learning rate adds the correction: "
            "docs/semantics.md section 4)",
    "none": "EmbOptimType.NONE leaves the update to a dense optimizer; embcore's tables are "
            "updated by their own optimizer in the backward pass",
}
# Arguments that choose FBGEMM's kernels, caches and checks, not the math: accepted, unused.
IGNORED = frozenset({
    "cache_load_factor", "cache_algorithm", "cache_reserved_memory", "cache_precision",
    "prefetch_pipeline", "enforce_hbm", "bounds_check_mode", "output_dtype",
    "stochastic_rounding",  # read by the tables (a 16-bit table's rounding), not the optimizer
})
KNOWN = frozenset({"optimizer", "learning_rate", "eps", "weight_decay", "weight_decay_mode",
                   "gradient_clipping", "max_gradient"}) | IGNORED


def optimizer_name(optimizer: Any) -> str:
    """FBGEMM's ``EmbOptimType`` value of ``optimizer`` (an ``EmbOptimType``, or its name or value
    as a string, any case): ``"exact_adagrad"`` for ``EmbOptimType.EXACT_ADAGRAD``.

    Raises:
        TypeError: neither an enum member nor a string.
    """
    if isinstance(optimizer, enum.Enum):
        optimizer = optimizer.value
    if not isinstance(optimizer, str):
        raise TypeError(f"fused_params['optimizer'] must be an fbgemm_gpu EmbOptimType or its "
                        f"name, got {type(optimizer).__name__} {optimizer!r}")
    name = optimizer.lower()
    return {"exact_rowwise_adagrad": "exact_row_wise_adagrad",
            "rowwise_adagrad": "row_wise_adagrad"}.get(name, name)


def from_fused_params(fused_params: Mapping[str, Any]) -> Optimizer:
    """The embcore optimizer with the math of TorchRec's / FBGEMM's ``fused_params``.

    - ``EXACT_SGD`` (and ``SGD``) -> ``ec.SGD(learning_rate)``;
    - ``EXACT_ADAGRAD`` -> ``ec.Adagrad(learning_rate, initial_accumulator_value=0)``;
    - ``EXACT_ROWWISE_ADAGRAD`` -> ``ec.RowwiseAdagrad(learning_rate,
      initial_accumulator_value=0)``.

    ``learning_rate`` defaults to FBGEMM's 0.01, ``optimizer`` to its ``EXACT_SGD``. ``eps`` is
    accepted and not modelled: FBGEMM divides by ``sqrt(a) + eps``, embcore by ``sqrt(a)`` (a
    relative difference of ``eps / sqrt(a)``). Cache, prefetch and bounds-check arguments
    (``IGNORED``) choose FBGEMM's kernels and are ignored.

    Raises:
        ValueError: another optimizer (naming the embcore one to use, where there is one), a
            ``weight_decay`` other than 0 (a negative one said so), ``gradient_clipping=True``,
            or an unknown key.
        TypeError: a non-mapping, an ``optimizer`` or number of the wrong type, or a
            ``stochastic_rounding`` that is not a bool.
    """
    stochastic_rounding(fused_params)
    unknown = sorted(str(k) for k in fused_params if k not in KNOWN)
    if unknown:
        raise ValueError(f"fused_params: unknown or unsupported keys {unknown}; embcore reads "
                         f"{sorted(KNOWN - IGNORED)} and ignores {sorted(IGNORED)}")
    name = optimizer_name(fused_params.get("optimizer", DEFAULT_OPTIMIZER))
    if name not in _RULES:
        why = _WHY_NOT.get(name, "embcore has no optimizer with its math")
        raise ValueError(f"fused_params: optimizer {name!r} is not supported: {why}. Supported: "
                         f"{', '.join(sorted(_RULES))}; or pass optimizer= an embcore "
                         f"optimizer (ec.SGD, ec.Adagrad, ec.RowwiseAdagrad, ec.Adam, ...)")
    lr = _number(fused_params, "learning_rate", DEFAULT_LEARNING_RATE)
    _number(fused_params, "eps", DEFAULT_EPS)
    decay = _number(fused_params, "weight_decay", 0.0)
    if not decay >= 0:
        raise ValueError(f"fused_params: weight_decay={fused_params['weight_decay']!r} is "
                         f"negative (or NaN); a decay is >= 0 (a negative one would grow every "
                         f"touched row), and embcore supports only weight_decay=0 here")
    if decay != 0:
        raise ValueError(f"fused_params: weight_decay={fused_params['weight_decay']!r} is not "
                         f"supported (FBGEMM's exact Adagrad and SGD take none; its row-wise "
                         f"modes differ); pass optimizer=ec.RowwiseAdagrad(weight_decay_factor="
                         f"...) for decoupled decay of the touched rows")
    if fused_params.get("gradient_clipping", False):
        raise ValueError("fused_params: gradient_clipping=True is not supported (fbgemm-gpu-cpu "
                         "1.8.0's CPU kernels ignore it); pass optimizer=ec.<Optimizer>("
                         "clipvalue=max_gradient) to clip each touched row's summed gradient")
    return _RULES[name](lr)


def stochastic_rounding(fused_params: Mapping[str, Any]) -> bool:
    """``fused_params["stochastic_rounding"]``: whether FP16 / BF16 tables round stochastically;
    FBGEMM's default, True, when absent (docs/semantics.md section 14).

    Raises:
        TypeError: a non-mapping, or a value that is not a bool (``"False"`` is not False).
    """
    if not isinstance(fused_params, Mapping):
        raise TypeError(f"fused_params must be a dict, got {type(fused_params).__name__}")
    value = fused_params.get("stochastic_rounding", DEFAULT_STOCHASTIC_ROUNDING)
    if not isinstance(value, bool):
        raise TypeError(f"fused_params['stochastic_rounding'] must be a bool, got "
                        f"{type(value).__name__} {value!r}; write True or False")
    return value


def _number(params: Mapping[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"fused_params[{key!r}] must be a real number, got "
                        f"{type(value).__name__} {value!r}")
    return float(value)
