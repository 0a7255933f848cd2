"""TorchRec's ``KeyedJaggedTensor`` (KJT), checked as TorchRec checks it and split by key.

Every path that takes a KJT reads it here (docs/semantics.md sections 1 and 15): ``ec.Embedding``,
``ec.EmbeddingLayer`` and serving, where a KJT stands for a dict of features
(``from_keyed_jagged``), and ``embcore.torchrec``'s modules (``read_keyed_jagged``). The checks
are those of TorchRec's ``validate_keyed_jagged_tensor`` (torchrec/sparse/
jagged_tensor_validator.py), as ``ValueError`` / ``TypeError`` naming the keys and the values:
unique keys; integer lengths / offsets, one per bag, the same number of bags per key; offsets
from 0 to the number of values, never decreasing (no negative length); lengths and offsets that
agree when both are given; 1-D values, and 1-D weights, one per value. A KJT is recognised by
``keys()``, ``values()``, ``offsets()``, ``weights_or_none()`` and ``stride()``, and read through
the first four (and, where it has them, ``lengths_or_none()``, ``offsets_or_none()``,
``variable_stride_per_key()``): torchrec is not needed. Its batch size is its number of lengths
over its number of keys.

The checks cost a few small tensor ops and one or two host reads per batch: a KJT given by its
lengths whose every bag holds one id (the common case of one-id features) is checked with one
``aminmax`` of its lengths, its offsets not read.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch


def is_keyed_jagged(x: Any) -> bool:
    """Whether ``x`` looks like TorchRec's ``KeyedJaggedTensor`` (duck-typed: torchrec is not a
    dependency): ``keys()``, ``values()``, ``offsets()``, ``weights_or_none()`` and
    ``stride()``."""
    return not isinstance(x, (dict, list, tuple)) and all(
        callable(getattr(x, m, None))
        for m in ("keys", "values", "offsets", "weights_or_none", "stride"))


@dataclass(frozen=True)
class KeyedJagged:
    """A checked KJT: ``K`` keys of ``B`` bags each, key ``i``'s bags its bags ``[i*B, (i+1)*B)``
    and its ids ``values[bounds[i]:bounds[i + 1]]``."""

    keys: list[str]
    values: torch.Tensor                # (N,) ids
    weights: torch.Tensor | None        # (N,) or None
    offsets: torch.Tensor | None        # (K * B + 1,) from 0 to N, never decreasing; None
                                        # when every bag holds one id (not read then)
    stride: int                         # B
    bounds: list[int]                   # (K + 1,) each key's first value, then N
    one_id_per_bag: bool                # every bag holds exactly one id
    position: dict[str, int]            # each key's place in ``keys``

    def ids(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Key ``key``'s jagged ids: ``(values (n,), offsets (B + 1,) from 0)``."""
        i, b = self.position[key], self.stride
        lo = self.bounds[i]
        if self.offsets is None:  # one id per bag
            return (self.values[lo:lo + b],
                    torch.arange(b + 1, dtype=torch.int64, device=self.values.device))
        return self.values[lo:self.bounds[i + 1]], self.offsets[i * b:(i + 1) * b + 1] - lo

    def weights_of(self, key: str) -> torch.Tensor | None:
        """Key ``key``'s weights ``(n,)``, or None."""
        if self.weights is None:
            return None
        i = self.position[key]
        return self.weights[self.bounds[i]:self.bounds[i + 1]]

    def dense(self, key: str) -> torch.Tensor:
        """Key ``key``'s ids ``(B,)``, one per bag (only when ``one_id_per_bag``)."""
        assert self.one_id_per_bag
        i = self.position[key]
        return self.values[i * self.stride:(i + 1) * self.stride]

    def lengths(self, key: str) -> torch.Tensor:
        """Key ``key``'s bag lengths ``(B,)``."""
        i, b = self.position[key], self.stride
        if self.offsets is None:  # one id per bag
            return torch.ones(b, dtype=torch.int64, device=self.values.device)
        return torch.diff(self.offsets[i * b:(i + 1) * b + 1])

    def require(self, wanted: Collection[str], exact: bool, what: str = "features") -> None:
        """Checks that the KJT holds every key of ``wanted`` (``exact``: and no other).

        Raises:
            ValueError: naming the keys that are missing (or that differ).
        """
        if exact and set(self.keys) != set(wanted):
            raise ValueError(f"the KeyedJaggedTensor's keys {sorted(self.keys)} differ from "
                             f"feature_config's {sorted(map(str, wanted))}")
        missing = sorted(set(wanted) - set(self.keys))
        if missing:
            raise ValueError(f"the KeyedJaggedTensor lacks {what} {missing} (it has "
                             f"{sorted(self.keys)})")


def read_keyed_jagged(kjt: Any) -> KeyedJagged:
    """``kjt`` checked as TorchRec's ``validate_keyed_jagged_tensor`` checks it.

    Raises:
        ValueError: duplicate keys, a batch size per key (variable stride), lengths that are
            not one per bag with the same number of bags per key, offsets that do not run from 0
            to the number of values or that decrease (a negative length), lengths and offsets
            that disagree, values or weights not 1-D, or a number of weights other than the
            number of values; each naming the keys and the numbers.
        TypeError: lengths or offsets that are not integers.
    """
    keys = list(kjt.keys())
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"the KeyedJaggedTensor's keys {keys} repeat {dup}; keys must be unique "
                         f"(one entry per feature)")
    where = f"the KeyedJaggedTensor (keys {keys})"
    if callable(getattr(kjt, "variable_stride_per_key", None)) and kjt.variable_stride_per_key():
        raise ValueError(f"{where} has a batch size per key (variable stride), which is not "
                         f"supported; give every key the same batch size")
    given_lengths = _given(kjt, "lengths", where)
    given_offsets = _given(kjt, "offsets", where)
    if given_lengths is not None and given_lengths.dim() != 1:
        raise ValueError(f"{where}: lengths must be 1-D (one per bag), got shape "
                         f"{list(given_lengths.shape)}")
    values, weights = kjt.values(), kjt.weights_or_none()
    if values.dim() != 1:
        raise ValueError(f"{where}: values must be 1-D (one id per entry), got shape "
                         f"{list(values.shape)}")
    # the usual KJT holds lengths and computes its offsets from them: read when needed
    lengths_only = given_lengths is not None and given_offsets is None
    offsets = None if lengths_only else offsets_of(kjt, where)
    n, k = values.numel(), len(keys)
    bags = offsets.numel() - 1 if offsets is not None else \
        given_lengths.numel() if given_lengths is not None else 0
    if weights is not None and (weights.dim() != 1 or weights.numel() != n):
        raise ValueError(f"{where} has {weights.numel()} weights of shape "
                         f"{list(weights.shape)} for {n} values; give one weight per value "
                         f"(1-D, the values' length)")
    b = bags // k if k else 0
    if bags != k * b:
        raise ValueError(f"{where} has {bags} lengths for {k} keys; give one length per bag, "
                         f"the same number of bags for every key (a multiple of {max(k, 1)} "
                         f"lengths)")
    position = {key: i for i, key in enumerate(keys)}
    if given_lengths is not None and lengths_only and n == bags > 0 and \
            torch.stack(torch.aminmax(given_lengths)).tolist() == [1, 1]:
        # every bag holds one id (N lengths of 1): the offsets are not needed
        return KeyedJagged(keys=keys, values=values, weights=weights, offsets=None, stride=b,
                           bounds=[i * b for i in range(k + 1)], one_id_per_bag=True,
                           position=position)
    if offsets is None:
        offsets = offsets_of(kjt, where)  # (of the lengths: their cumulative sum)
    if offsets.numel() != bags + 1:
        raise ValueError(f"{where} has {offsets.numel()} offsets for {bags} lengths; give "
                         f"lengths or offsets = [0, cumsum of the lengths]")
    if given_lengths is not None and lengths_only:
        lengths = given_lengths  # (K * B,)
    else:
        lengths = torch.diff(offsets)  # (K * B,)
        if given_lengths is not None and not (given_lengths.shape == lengths.shape and
                                              torch.equal(given_lengths.to(lengths), lengths)):
            raise ValueError(f"{where}: its {given_lengths.numel()} lengths are not the "
                             f"differences of its {bags + 1} offsets; give lengths or offsets, "
                             f"or both that agree")
    # each key's first offset, then N (the last offset); the shortest bag
    bounds = (offsets[::b] if b else offsets[:1].expand(k + 1)).tolist()  # (K + 1,)
    low = int(lengths.min()) if bags else 0
    if bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"{where}: offsets run from {bounds[0]} to {bounds[-1]} but there are "
                         f"{n} values; the lengths must sum to the number of values (offsets "
                         f"from 0 to {n}), as TorchRec requires")
    if low < 0:
        bad = int((lengths < 0).nonzero()[0])
        raise ValueError(f"{where}: key {keys[bad // b]!r}, bag {bad % b} has length "
                         f"{int(lengths[bad])}; lengths must be >= 0 (offsets never decrease)")
    return KeyedJagged(keys=keys, values=values, weights=weights, offsets=offsets, stride=b,
                       bounds=bounds, one_id_per_bag=bags > 0 and low == 1 and n == bags,
                       position=position)


def offsets_of(kjt: Any, where: str) -> torch.Tensor:
    """``kjt.offsets()``, checked: integers, 1-D, at least one."""
    offsets = _given(kjt, "offsets", where, kjt.offsets())
    assert offsets is not None
    if offsets.dim() != 1 or offsets.numel() == 0:
        raise ValueError(f"{where}: offsets must be 1-D and hold at least one entry, got shape "
                         f"{list(offsets.shape)}")
    return offsets


def _given(kjt: Any, name: str, where: str, value: Any = None) -> torch.Tensor | None:
    """The KJT's ``lengths`` / ``offsets`` as given (``value``: as read), checked to be
    integers (a KJT without ``<name>_or_none()``: None)."""
    if value is None:
        read = getattr(kjt, f"{name}_or_none", None)
        value = read() if callable(read) else None
    if value is not None and (value.is_floating_point() or value.is_complex()
                              or value.dtype == torch.bool):
        raise TypeError(f"{where}: {name} must be integers, got {value.dtype}; give "
                        f"torch.int32 or torch.int64 {name}")
    return value


def from_keyed_jagged(template: Any, kjt: Any, weights: Any = None
                      ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A ``KeyedJaggedTensor`` as ``({key: jagged ids}, {key: jagged weights} or None)``, checked
    (``read_keyed_jagged``).

    Its keys must be the keys of ``template``, a dict of features. Key ``k``'s bags are bags
    ``[i*B, (i+1)*B)`` of the KJT (``i`` its position in ``keys()``, ``B`` its number of lengths
    over its number of keys). ``weights``: the call's own weights argument, which must be None
    (a KJT carries its weights).

    Raises:
        ValueError: a template that is not a dict, keys that differ, weights given beside the
            KJT, or a KJT that ``read_keyed_jagged`` refuses. TypeError: non-integer lengths
            or offsets.
    """
    if not isinstance(template, dict):
        raise ValueError("a KeyedJaggedTensor input needs a feature_config that is a dict keyed "
                         "by its keys")
    if weights is not None:
        raise ValueError("weights were given beside a KeyedJaggedTensor, which carries its own "
                         "(its weights_or_none()); build the KeyedJaggedTensor with weights= "
                         "and pass weights=None")
    kj = read_keyed_jagged(kjt)
    kj.require(list(template), exact=True)
    ids, ws = {}, {}
    for key in kj.keys:
        values, local = kj.ids(key)
        local = local.to(torch.int64)
        ids[key] = torch.nested.nested_tensor_from_jagged(values, local)
        w = kj.weights_of(key)
        if w is not None:
            ws[key] = torch.nested.nested_tensor_from_jagged(w, local)
    return ids, (ws if kj.weights is not None else None)
