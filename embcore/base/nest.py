"""Nested structures (dict / list / tuple of leaves) that mirror the user's feature_config.

The feature_config is the template: every features, weights, activations and gradients structure
is read by walking the template, so a mismatch is reported with the path where it happens.
A structure nests at most ``MAX_DEPTH`` (100) containers deep: a deeper one (or one that holds
itself) is a ``ValueError`` naming the path where the limit is passed, not a ``RecursionError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# The most dicts / lists / tuples a structure may nest inside each other (the walks recurse once
# per level; far below Python's recursion limit, far above any real feature_config).
MAX_DEPTH = 100


def check_depth(depth: int, where: str) -> None:
    """``ValueError`` when a container sits ``depth`` containers deep, more than ``MAX_DEPTH``
    allow (``depth`` counts the container itself: a top-level dict is at depth 1)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: the structure nests more than {MAX_DEPTH} levels deep (dicts, "
                         f"lists and tuples inside each other); at most {MAX_DEPTH} are allowed "
                         f"(does it hold itself?)")


def leaves_with_paths(template: Any, is_leaf: Callable[[Any], bool],
                      prefix: str = "") -> list[tuple[str, Any]]:
    """Flattens ``template`` depth first (dicts in insertion order) into (path, leaf) pairs.

    Raises:
        TypeError: something that is neither a leaf nor a dict, list or tuple, naming its path.
        ValueError: containers nested more than ``MAX_DEPTH`` deep, naming the path.
    """
    out: list[tuple[str, Any]] = []

    def walk(t: Any, path: str, depth: int) -> None:
        if is_leaf(t):
            out.append((path, t))
            return
        if isinstance(t, dict):
            items: Sequence[tuple[Any, Any]] = list(t.items())
        elif isinstance(t, (list, tuple)):
            items = list(enumerate(t))
        else:
            raise TypeError(f"feature_config{_fmt(path)}: expected a FeatureConfig or a dict, "
                            f"list or tuple of them, got {type(t).__name__}")
        check_depth(depth + 1, f"feature_config{_fmt(path)}")
        for key, value in items:
            walk(value, f"{path}/{key}" if path else str(key), depth + 1)

    walk(template, prefix, 0)
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
        ValueError: naming the path where ``value`` differs from the template (or where the
            template nests more than ``MAX_DEPTH`` deep).
    """
    out: list[Any] = []
    _flatten_into(out, template, value, is_leaf, what, prefix, 0)
    return out


def _flatten_into(out: list[Any], template: Any, value: Any, is_leaf: Callable[[Any], bool],
                  what: str, prefix: str, depth: int) -> None:
    """``flatten_like``'s walk: appends ``value``'s leaves to ``out`` (``depth``: containers
    above ``template``)."""
    if is_leaf(template):
        out.append(value)
        return
    where = f"{what}{_fmt(prefix)}"
    check_depth(depth + 1, where)
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
    for (key, v), sub in zip(pairs, subs):
        _flatten_into(out, sub, v, is_leaf, what, f"{prefix}/{key}" if prefix else str(key),
                      depth + 1)


def unflatten_like(template: Any, leaves: Sequence[Any], is_leaf: Callable[[Any], bool]) -> Any:
    """Builds a structure shaped like ``template`` from leaves in flatten order.

    Raises:
        ValueError: a template nested more than ``MAX_DEPTH`` deep.
    """
    it = iter(leaves)

    def build(t: Any, depth: int) -> Any:
        if is_leaf(t):
            return next(it)
        check_depth(depth + 1, "feature_config")
        if isinstance(t, dict):
            return {k: build(v, depth + 1) for k, v in t.items()}
        items = [build(v, depth + 1) for v in t]
        if isinstance(t, tuple):
            return type(t)(*items) if hasattr(t, "_fields") else tuple(items)
        return items

    out = build(template, 0)
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

