"""Selections on the device whose sizes the host need not know: the k smallest by (score, key),
in order, with k on the device (``smallest_ordered``), and the first n set entries of a mask
(``first_set``). Neither synchronises with the device.

A raw-id map evicts the resident ids of lowest (score, id) (docs/semantics.md section 9) and
forgets the counted ids of lowest (last seen, id); how many is known only on the device.
``smallest_ordered`` answers with tensors of a size the host knows (an upper bound ``kmax`` of
k), in ``O(n)`` (two ``topk`` of ``kmax``) plus ``O(kmax log kmax)``, exact for any int64 keys:

1. ``s_k``, the k-th smallest valid score, from the ``kmax`` smallest scores (``topk``);
2. the valid entries of score below ``s_k`` (fewer than k, all among those ``kmax``), ordered by
   (score, key) with two stable sorts;
3. then the entries of score ``s_k`` of smallest keys (a second ``topk``, of the keys): the key
   ``2**63 - 1`` is also what masks the others, so an entry holding it (at most one: keys are
   distinct) is placed after the tied keys below it, by a mask rather than by value.

>>> score = torch.tensor([5, 3, 3, 9, 3])
>>> key = torch.tensor([50, 31, 30, 90, 2**63 - 1])
>>> valid = torch.tensor([True, True, True, True, True])
>>> smallest_ordered(score, key, valid, torch.tensor(4), 4).tolist()
[2, 1, 4, 0]
"""

from __future__ import annotations

import torch

_BIG = 2**63 - 1


def smallest_ordered(score: torch.Tensor, key: torch.Tensor, valid: torch.Tensor,
                     k: torch.Tensor | int, kmax: int) -> torch.Tensor:
    """The indices of the ``k`` valid entries smallest by (score, key), in that order.

    Args:
        score: (n,) int64 below ``2**63 - 1`` where valid.
        key: (n,) int64, distinct among the valid entries.
        valid: (n,) bool.
        k: 0-d int64 on the device, ``0 <= k <= min(kmax, valid entries)``; or an int, where
            the host knows it (fewer ops: no 0-d index to gather by).
        kmax: the host's bound on k, ``0 <= kmax <= n``.

    Returns:
        (kmax,) int64 indices into the entries: the first k in (score, key) order; the others
        are unspecified (any index in ``[0, n)``).
    """
    if kmax == 0:
        return torch.empty(0, dtype=torch.int64, device=score.device)
    s = torch.where(valid, score, _BIG)  # (n,)
    vals, idx = torch.topk(s, kmax, largest=False, sorted=True)  # (kmax,)
    if isinstance(k, int):  # (1,): the k-th smallest score, when k >= 1
        s_k = vals[min(max(k - 1, 0), kmax - 1):][:1]
    else:  # (gathered: indexing by a 0-d tensor reads it)
        s_k = vals.index_select(0, (k - 1).clamp(0, kmax - 1).reshape(1))
    below = vals < s_k  # (kmax,) the entries certainly taken: a prefix of fewer than k
    c_below = below.sum()  # 0-d
    b_key = torch.where(below, key[idx], _BIG)
    b_score = torch.where(below, vals, _BIG)
    by_key = torch.sort(b_key, stable=True).indices
    by_score = torch.sort(b_score[by_key], stable=True).indices
    below_ordered = idx[by_key[by_score]]  # (kmax,) the first c_below in (score, key) order

    tie = valid & (score == s_k)  # (n,)
    t_key = torch.where(tie, key, _BIG)
    t_vals, t_idx = torch.topk(t_key, kmax, largest=False, sorted=True)  # (kmax,)
    c_tie = (t_vals < _BIG).sum()  # 0-d: the tied entries of key below 2**63 - 1, first
    top = tie & (key == _BIG)  # (n,) at most one entry
    top_at = top.to(torch.int8).argmax()  # 0-d (its index, when there is one)
    at = torch.arange(kmax, device=score.device)
    tied = torch.where(at < c_tie, t_idx, top_at)  # (kmax,) the tied entries by key

    return torch.where(at < c_below, below_ordered, tied[(at - c_below).clamp(0, kmax - 1)])


def first_set(mask: torch.Tensor, n: int) -> torch.Tensor:
    """(n + 1,) int64: the indices of the first ``n`` entries of the (m,) bool ``mask`` that are
    set, ascending, by a prefix sum (no host synchronisation); the entries past how many there
    are, and the last, unspecified.

    >>> first_set(torch.tensor([False, True, True, False, True]), 2)[:2].tolist()
    [1, 2]
    """
    cum = mask.cumsum(0)  # (m,)
    out = torch.zeros(n + 1, dtype=torch.int64, device=mask.device)
    at = torch.where(mask & (cum <= n), cum - 1, n)
    return out.scatter_(0, at, torch.arange(mask.numel(), dtype=torch.int64, device=mask.device))
