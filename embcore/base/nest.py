"""Nested structures (dict / list / tuple of leaves) that mirror the user's feature_config.

The feature_config is the template: every features, weights, activations and gradients structure
is read by walking the template, so a mismatch is reported with the path where it happens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def leaves_with_paths(template: Any, is_leaf: Callable[[Any], bool],
                      prefix: str = "") -> list[tuple[str, Any]]:
    """Flattens ``template`` depth first (dicts in insertion order) into (path, leaf) pairs."""
    if is_leaf(template):
        return [(prefix, template)]
    if isinstance(template, dict):
        items: Sequence[tuple[Any, Any]] = list(template.items())
    elif isinstance(template, (list, tuple)):
        items = list(enumerate(template))
    else:
        raise TypeError(f"feature_config{_fmt(prefix)}: expected a FeatureConfig or a dict, list or "
                        f"tuple of them, got {type(template).__name__}")
    out: list[tuple[str, Any]] = []
    for key, value in items:
        out += leaves_with_paths(value, is_leaf, f"{prefix}/{key}" if prefix else str(key))
    return out


def flatten_like(template: Any, value: Any, is_leaf: Callable[[Any], bool], what: str,
                 prefix: str = "") -> list[Any]:
    """Reads ``value`` in the order of ``template``'s leaves; ``value`` must have its structure.

    Args:
        template: the feature_config structure.
        value: a structure of the same shape (features, weights, gradients).
        is_leaf: tells the template's leaves.
        what: the argument's name, for errors ("features", "weights", ...).

    Raises:
        ValueError: naming the path where ``value`` differs from the template.
    """
    if is_leaf(template):
        return [value]
    where = f"{what}{_fmt(prefix)}"
    if isinstance(template, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a dict with keys {sorted(map(str, template))} "
                             f"(the structure of feature_config), got {type(value).__name__}")
        if set(value) != set(template):
            missing = sorted(map(str, set(template) - set(value)))
            extra = sorted(map(str, set(value) - set(template)))
            raise ValueError(f"{where}: keys differ from feature_config: missing {missing}, "
                             f"unexpected {extra}")
        pairs = [(k, value[k]) for k in template]
        subs = [template[k] for k in template]
    else:
        if not isinstance(value, (list, tuple)) or len(value) != len(template):
            got = (f"{type(value).__name__} of length {len(value)}"
                   if isinstance(value, (list, tuple)) else type(value).__name__)
            raise ValueError(f"{where}: expected a sequence of length {len(template)} "
                             f"(the structure of feature_config), got {got}")
        pairs = list(enumerate(value))
        subs = list(template)
    out: list[Any] = []
    for (key, v), sub in zip(pairs, subs):
        out += flatten_like(sub, v, is_leaf, what, f"{prefix}/{key}" if prefix else str(key))
    return out


def unflatten_like(template: Any, leaves: Sequence[Any], is_leaf: Callable[[Any], bool]) -> Any:
    """Builds a structure shaped like ``template`` from leaves in flatten order."""
    it = iter(leaves)

    def build(t: Any) -> Any:
        if is_leaf(t):
            return next(it)
        if isinstance(t, dict):
            return {k: build(v) for k, v in t.items()}
        items = [build(v) for v in t]
        if isinstance(t, tuple):
            return type(t)(*items) if hasattr(t, "_fields") else tuple(items)
        return items

    out = build(template)
    assert next(it, None) is None, "more leaves than the template holds"
    return out


class Structure:
    """A template's flattening, with a shortcut for the common case: a flat dict of leaves is
    read and built by its keys; any other structure goes through ``flatten_like`` /
    ``unflatten_like`` (which also check it)."""

    def __init__(self, template: Any, is_leaf: Callable[[Any], bool]) -> None:
        self.template, self.is_leaf = template, is_leaf
        self.keys = (tuple(template) if isinstance(template, dict)
                     and all(is_leaf(v) for v in template.values()) else None)

    def flatten(self, value: Any, what: str) -> list[Any]:
        """``value``'s leaves in flatten order (``what`` names it in errors)."""
        flat = self.flat_dict(value)
        return flat if flat is not None else flatten_like(self.template, value, self.is_leaf,
                                                          what)

    def flat_dict(self, value: Any) -> list[Any] | None:
        """``value``'s leaves when the template is a flat dict and ``value`` a dict of exactly
        its keys (``flatten_like``'s result, without its walk); None otherwise."""
        keys = self.keys
        if keys is None or type(value) is not dict or len(value) != len(keys):
            return None
        try:
            return [value[k] for k in keys]
        except KeyError:
            return None

    def unflatten(self, flat: Sequence[Any]) -> Any:
        """The template's structure from its leaves in flatten order."""
        if self.keys is not None:
            return dict(zip(self.keys, flat))
        return unflatten_like(self.template, list(flat), self.is_leaf)


def _fmt(prefix: str) -> str:
    return f"[{prefix!r}]" if prefix else ""


def is_keyed_jagged(x: Any) -> bool:
    """Whether ``x`` looks like TorchRec's ``KeyedJaggedTensor`` (duck-typed: torchrec is not a
    dependency): ``keys()``, ``values()``, ``offsets()`` and ``weights_or_none()``."""
    return not isinstance(x, (dict, list, tuple)) and all(
        callable(getattr(x, m, None))
        for m in ("keys", "values", "offsets", "weights_or_none", "stride"))


def from_keyed_jagged(template: Any, kjt: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A ``KeyedJaggedTensor`` as ``({key: jagged ids}, {key: jagged weights} or None)``.

    Its keys must be the keys of ``template``, a dict of features. Key ``k``'s bags are rows
    ``[i*B, (i+1)*B)`` of the KJT (``i`` its position in ``keys()``, ``B = stride()``).

    Raises:
        ValueError: a template that is not a dict, keys that differ, or variable batch sizes
            per key.
    """
    keys = list(kjt.keys())
    if not isinstance(template, dict):
        raise ValueError("a KeyedJaggedTensor input needs a feature_config that is a dict keyed "
                         "by its keys")
    if set(keys) != set(template):
        raise ValueError(f"the KeyedJaggedTensor's keys {sorted(keys)} differ from "
                         f"feature_config's {sorted(map(str, template))}")
    if callable(getattr(kjt, "variable_stride_per_key", None)) and kjt.variable_stride_per_key():
        raise ValueError("a KeyedJaggedTensor with a batch size per key (variable stride) is not "
                         "supported; give every key the same batch size")
    import torch  # (nest.py is otherwise torch-free)

    values, offsets, weights, b = kjt.values(), kjt.offsets(), kjt.weights_or_none(), kjt.stride()
    if offsets.numel() != len(keys) * b + 1:
        raise ValueError(f"the KeyedJaggedTensor has {offsets.numel()} offsets for {len(keys)} "
                         f"keys of {b} bags; expected {len(keys) * b + 1}")
    ids, ws = {}, {}
    for i, k in enumerate(keys):
        o = offsets[i * b:(i + 1) * b + 1]  # (B + 1,)
        lo, hi = int(o[0]), int(o[-1])
        local = (o - lo).to(torch.int64)
        ids[k] = torch.nested.nested_tensor_from_jagged(values[lo:hi], local)
        if weights is not None:
            ws[k] = torch.nested.nested_tensor_from_jagged(weights[lo:hi], local)
    return ids, (ws if weights is not None else None)
