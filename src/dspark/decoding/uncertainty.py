"""Standard errors of τ, so that two drafters' τ can be told apart from prompt sampling noise.

τ (``engine.tau``) is a ratio of sums over one benchmark's rounds: Σ (accepted + 1) / rounds. The
rounds of one request are not independent (an easy prompt gives many long acceptances), so the
unit of sampling is the request (one prompt): request i contributes y_i = Σ (accepted + 1) over
its rounds and x_i = its number of rounds, and τ̂ = Σ y_i / Σ x_i is the classical ratio
estimator. Its standard error is the linearised (delta-method) one,

    SE(τ̂) = sqrt( n / (n - 1) · Σ (y_i - τ̂ x_i)² ) / Σ x_i ,

over the n requests: the spread of the per-request residuals, so a request with many rounds
weighs in proportion to them. It needs n >= 2 (None otherwise) and is close to a bootstrap over
prompts once n is a few dozen. A macro average over independent benchmarks has the standard error
of a mean of independent estimates, sqrt(Σ SE_b²) / k.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["mean_stderr", "per_request_totals", "ratio_stderr", "tau_stderr"]


def _get(rec, key):
    return rec[key] if isinstance(rec, dict) else getattr(rec, key)


def ratio_stderr(numerators: Sequence[float], denominators: Sequence[float]) -> float | None:
    """Delta-method standard error of Σ y / Σ x over independent units (y_i, x_i); None for fewer
    than two units or Σ x = 0."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators against {len(denominators)} denominators")
    n, total_x = len(numerators), float(sum(denominators))
    if n < 2 or total_x <= 0:
        return None
    ratio = sum(numerators) / total_x
    residuals = sum((y - ratio * x) ** 2 for y, x in zip(numerators, denominators))
    return math.sqrt(n / (n - 1) * residuals) / total_x


def per_request_totals(records: Iterable) -> dict:
    """request id -> (Σ (accepted + 1), rounds) over that request's round records (RoundRecord
    objects or the dicts of rounds.jsonl)."""
    totals: dict = {}
    for r in records:
        tokens, rounds = totals.get(_get(r, "request"), (0, 0))
        totals[_get(r, "request")] = (tokens + _get(r, "accepted") + 1, rounds + 1)
    return totals


def tau_stderr(records: Iterable) -> float | None:
    """Standard error of ``engine.tau`` over the same records, requests as the sampling unit."""
    totals = list(per_request_totals(records).values())
    return ratio_stderr([t for t, _ in totals], [n for _, n in totals])


def mean_stderr(errors: Sequence[float | None]) -> float | None:
    """Standard error of the mean of independent estimates with these errors (None if any is)."""
    if not errors or any(e is None for e in errors):
        return None
    return math.sqrt(sum(e * e for e in errors)) / len(errors)
