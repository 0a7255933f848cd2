"""Exact ROC AUC and log loss over a whole evaluation set (numpy only).

``roc_auc`` is the probability that a random positive example scores above a random negative
one, ties counting one half: the Mann-Whitney U statistic over midranks, O(n log n), exact (no
binning, unlike streaming approximations such as ``tf.keras.metrics.AUC``'s 200 thresholds).

    >>> roc_auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
    0.75
    >>> roc_auc([0, 1], [0.5, 0.5])  # a tie counts 1/2
    0.5

With only one class present the AUC is undefined: ``roc_auc`` raises ``ValueError`` saying so
(it never returns nan silently).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def _labels_scores(labels: ArrayLike, scores: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels, dtype=np.float64).ravel()  # (n,)
    s = np.asarray(scores, dtype=np.float64).ravel()  # (n,)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length: {y.size} and {s.size}")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("labels must be 0 or 1")
    if np.isnan(s).any():
        raise ValueError("scores contain nan")
    return y, s


def roc_auc(labels: ArrayLike, scores: ArrayLike) -> float:
    """Exact, tie-aware area under the ROC curve.

    Args:
        labels: (n,) 0/1.
        scores: (n,) any real scores (probabilities or logits: only their order matters).

    Returns:
        P(score of a positive > score of a negative) + 1/2 P(equal), over all pairs.

    Raises:
        ValueError: only one class is present (AUC undefined), lengths differ, labels not 0/1,
            or nan scores.
    """
    y, s = _labels_scores(labels, scores)
    positives = int(y.sum())
    negatives = y.size - positives
    if positives == 0 or negatives == 0:
        raise ValueError(f"AUC is undefined with one class only ({positives} positive, "
                         f"{negatives} negative examples)")
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]  # (n,)
    # midranks: a run of equal scores at 0-based positions [i, j) gets rank (i + j + 1) / 2
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])  # (runs,)
    ends = np.r_[starts[1:], s.size]  # (runs,)
    run_rank = (starts + ends + 1) / 2.0  # (runs,) 1-based midranks
    ranks = np.repeat(run_rank, ends - starts)  # (n,) in sorted order
    positive_rank_sum = float(ranks[y[order] == 1].sum())
    u = positive_rank_sum - positives * (positives + 1) / 2.0
    return u / (positives * negatives)


def log_loss(labels: ArrayLike, probabilities: ArrayLike, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy, natural log; probabilities clipped to [eps, 1 - eps].

    Raises:
        ValueError: empty input, lengths differ, labels not 0/1, nan probabilities.
    """
    y, p = _labels_scores(labels, probabilities)
    if y.size == 0:
        raise ValueError("log loss of an empty set")
    p = np.clip(p, eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))
