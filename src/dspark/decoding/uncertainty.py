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

Two drafters evaluated on the same prompts are compared *paired* (``paired_comparison``): an easy
prompt is easy for both (at T = 0 both verify the very same greedy answer), so their τ's errors are
strongly correlated and adding them as independent overstates the error of their difference many
times. Each request's linearised influence on τ̂ is u_i = (y_i - τ̂ x_i) / Σ x; a smooth function of
several τ̂'s (a macro average, a difference of two, their ratio) has as its influence the same
combination of the u_i, and its standard error is sqrt(Σ_b n_b / (n_b - 1) · Σ_i g_bi²) over the
benchmarks b and their requests i (the same formula as above when there is one τ̂).

The conditional acceptance at draft position k (Fig. 2) is a ratio of the same kind: the rounds that
accepted k over those that reached it (verified k with 1..k-1 accepted), summed over a request's
rounds (``per_request_positions``); ``paired_comparison`` of those totals compares two drafters at
one position.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = [
    "mean_stderr", "paired_comparison", "paired_contrast", "per_request_positions", "per_request_totals",
    "ratio_stderr", "tau_stderr",
]  # fmt: skip


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


def per_request_positions(records: Iterable, gamma: int) -> dict:
    """request id -> ([accepted at k], [reached k]) for draft positions k = 1..γ over that request's
    rounds: a round reaches k when it verified k with 1..k-1 all accepted (Fig. 2's conditional
    acceptance is Σ accepted / Σ reached over the rounds; records without a request count as one)."""
    counts: dict = {}
    for r in records:
        request = r.get("request") if isinstance(r, dict) else r.request
        accepted, reached = counts.setdefault(request, ([0] * gamma, [0] * gamma))
        n, ell = _get(r, "accepted"), _get(r, "proposed")
        for k in range(min(n + 1, ell, gamma)):  # 0-based k is reached when n >= k and ell > k
            reached[k] += 1
            accepted[k] += n > k
    return counts


def tau_stderr(records: Iterable) -> float | None:
    """Standard error of ``engine.tau`` over the same records, requests as the sampling unit."""
    totals = list(per_request_totals(records).values())
    return ratio_stderr([t for t, _ in totals], [n for _, n in totals])


def mean_stderr(errors: Sequence[float | None]) -> float | None:
    """Standard error of the mean of independent estimates with these errors (None if any is)."""
    if not errors or any(e is None for e in errors):
        return None
    return math.sqrt(sum(e * e for e in errors)) / len(errors)


def _influences(totals: dict) -> tuple[float, dict]:
    """τ̂ = Σ y / Σ x over ``totals`` (request -> (y, x)) and each request's influence on it."""
    total_x = float(sum(x for _, x in totals.values()))
    if total_x <= 0:
        raise ValueError("no rounds: τ is undefined")
    tau_hat = sum(y for y, _ in totals.values()) / total_x
    return tau_hat, {k: (y - tau_hat * x) / total_x for k, (y, x) in totals.items()}


def _check_pairs(rows: Sequence[dict]) -> None:
    """A ValueError naming what does not pair: other benchmarks, or a benchmark whose requests differ."""
    first = rows[0]
    if not first:
        raise ValueError("the rows hold no benchmarks")
    for other in rows[1:]:
        if set(other) != set(first):
            raise ValueError(
                f"the rows were evaluated on different benchmarks: {sorted(first)} against {sorted(other)}"
            )
        for name in first:
            if set(first[name]) != set(other[name]):
                raise ValueError(
                    f"{name}: the rows' requests differ ({len(first[name])} against {len(other[name])})"
                )


def _fit(rows: Sequence[dict]) -> tuple[list[float], dict[str, list[dict]]]:
    """Each row's macro τ (the mean over benchmarks) and, per benchmark, each row's per-request
    influences on its τ̂, for rows that pair (``_check_pairs``)."""
    _check_pairs(rows)
    k = len(rows[0])
    fitted = {name: [_influences(r[name]) for r in rows] for name in rows[0]}
    macros = [sum(f[j][0] for f in fitted.values()) / k for j in range(len(rows))]
    return macros, {name: [u for _, u in per_row] for name, per_row in fitted.items()}


def _paired_stderr(influences: dict[str, list[dict]], combine) -> float | None:
    """Standard error of a smooth function of the rows' macro τs whose influence per request is
    ``combine([u_row(i) for each row])``: sqrt(Σ_b n_b / (n_b − 1) Σ_i g_bi²); None with fewer than two
    requests in a benchmark."""
    total = 0.0
    for per_row in influences.values():
        n = len(per_row[0])
        if n < 2:
            return None
        total += n / (n - 1) * sum(combine([u[i] for u in per_row]) ** 2 for i in per_row[0])
    return math.sqrt(total)


def paired_contrast(rows: Sequence[dict], weights: Sequence[float]) -> dict:
    """Σ_j w_j · macro τ_j over rows evaluated on the same requests (each as ``paired_comparison``'s
    ``a``) and its paired standard error: e.g. weights (1, −1, −1, 1) over (A at 10, B at 10, A at 4,
    B at 4) is how much A's lead over B grows from 4 to 10, every prompt's difficulty cancelling."""
    if len(rows) != len(weights) or not rows:
        raise ValueError(f"{len(rows)} rows against {len(weights)} weights")
    macros, influences = _fit(rows)
    k = len(rows[0])
    return {
        "value": sum(w * m for w, m in zip(weights, macros)),
        "stderr": _paired_stderr(influences, lambda u: sum(w * x for w, x in zip(weights, u)) / k),
    }


def paired_comparison(a: dict, b: dict) -> dict:
    """Row ``a`` against row ``b`` evaluated on the same requests: ``a`` and ``b`` map each benchmark
    to its per-request totals (request -> (Σ (accepted + 1), rounds), ``per_request_totals``). The
    macro τ of each (the mean over benchmarks), their difference and ratio, each with its paired
    standard error (None with fewer than two requests in a benchmark). A ValueError names what
    does not pair: other benchmarks, or a benchmark whose requests differ."""
    (macro_a, macro_b), influences = _fit([a, b])
    k = len(a)
    ratio = macro_a / macro_b if macro_b else None
    return {
        "tau": macro_a,
        "baseline_tau": macro_b,
        "difference": macro_a - macro_b,
        "difference_stderr": _paired_stderr(influences, lambda u: (u[0] - u[1]) / k),
        "ratio": ratio,
        "ratio_stderr": None
        if ratio is None
        else _paired_stderr(influences, lambda u: (u[0] - ratio * u[1]) / (k * macro_b)),
    }
