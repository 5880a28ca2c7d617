"""τ's standard error over requests (dspark.decoding.uncertainty): a hand-computed case, the
degenerate ones, and a simulation showing it matches the spread of τ over repeated prompt sets."""

import math

import numpy as np
import pytest

from dspark.decoding.engine import tau
from dspark.decoding.uncertainty import (
    mean_stderr,
    paired_comparison,
    paired_contrast,
    per_request_positions,
    per_request_totals,
    ratio_stderr,
    tau_stderr,
)


def _rounds(request: str, accepted: list[int]) -> list[dict]:
    return [{"request": request, "round": i, "accepted": a} for i, a in enumerate(accepted)]


def test_hand_computed_case():
    # A: (2+1) + (0+1) = 4 tokens in 2 rounds; B: 2 in 1; C: 4 + 4 + 2 = 10 in 3 -> τ = 16/6 = 8/3.
    recs = _rounds("A", [2, 0]) + _rounds("B", [1]) + _rounds("C", [3, 3, 1])
    assert per_request_totals(recs) == {"A": (4, 2), "B": (2, 1), "C": (10, 3)}
    assert tau(recs) == pytest.approx(8 / 3)
    # Residuals y - τ x: 4 - 16/3 = -4/3, 2 - 8/3 = -2/3, 10 - 8 = 2; Σ² = 56/9;
    # SE = sqrt(3/2 · 56/9) / 6 = sqrt(28/3) / 6.
    assert tau_stderr(recs) == pytest.approx(math.sqrt(28 / 3) / 6)
    assert tau_stderr(recs) == pytest.approx(0.509175, abs=1e-6)
    # The order of the records does not matter; only the grouping by request does.
    assert tau_stderr(list(reversed(recs))) == pytest.approx(tau_stderr(recs))


def test_positions_count_the_rounds_that_reach_and_accept_each_position():
    """A round that accepted n of the ℓ it verified reached positions 1..min(n + 1, ℓ) and accepted 1..n;
    summed over a request's rounds, Fig. 2's curve is Σ accepted / Σ reached."""
    recs = [
        {"request": "A", "accepted": 2, "proposed": 4},  # reached 1, 2, 3; accepted 1, 2
        {"request": "A", "accepted": 4, "proposed": 4},  # reached and accepted all four
        {"request": "B", "accepted": 0, "proposed": 2},  # reached 1 only
        {"request": "B", "accepted": 1, "proposed": 1},  # a short round: reached and accepted 1
    ]
    counts = per_request_positions(recs, 4)
    assert counts == {"A": ([2, 2, 1, 1], [2, 2, 2, 1]), "B": ([1, 0, 0, 0], [2, 0, 0, 0])}
    # One position of two drafters, paired like τ: (accepted, reached) per request; here each request
    # gains alike over the baseline, so the paired error is 0.
    a = {"b": {"A": (2, 2), "B": (1, 2)}}
    b = {"b": {"A": (1, 2), "B": (0, 2)}}
    c = paired_comparison(a, b)
    assert c["difference"] == pytest.approx(0.75 - 0.25) and c["difference_stderr"] == pytest.approx(0.0)


def test_degenerate_cases():
    assert tau_stderr(_rounds("only", [3, 1, 2])) is None  # one request: no spread to measure
    assert tau_stderr([]) is None
    assert ratio_stderr([4.0, 6.0], [2.0, 3.0]) == 0.0  # every request at the same τ
    with pytest.raises(ValueError, match="2 numerators against 1 denominators"):
        ratio_stderr([1.0, 2.0], [1.0])
    assert mean_stderr([0.3, 0.4]) == pytest.approx(0.25)  # sqrt(0.09 + 0.16) / 2
    assert mean_stderr([0.3, None]) is None and mean_stderr([]) is None


def test_matches_the_spread_of_tau_over_repeated_prompt_sets():
    """Draw many prompt sets of 40 requests (each request its own acceptance rate and length, so
    rounds within a request are correlated); the standard error computed from one set must match
    the standard deviation of τ across sets."""
    rng = np.random.default_rng(0)
    sets, n, gamma = 2000, 40, 7
    p = rng.beta(2, 3, size=(sets, n))  # per-request acceptance probability
    rounds = 1 + rng.poisson(15, size=(sets, n))
    accepted = rng.binomial(gamma * rounds, p)  # Σ over a request's rounds of Binomial(γ, p)
    tokens = accepted + rounds
    taus = tokens.sum(1) / rounds.sum(1)
    errors = np.array([ratio_stderr(list(y), list(x)) for y, x in zip(tokens, rounds)])
    assert errors.mean() == pytest.approx(taus.std(), rel=0.08)
    # And it is a standard error, not a spread of requests: 4x the requests, half the error.
    assert ratio_stderr(list(np.tile(tokens[0], 4)), list(np.tile(rounds[0], 4))) == pytest.approx(
        errors[0] / 2 * math.sqrt((4 * n - 4) / (4 * n - 1)), rel=1e-9
    )


def _two_rows(rng, n: int, benchmarks: int = 2, gamma: int = 7):
    """Two drafters on the same prompts: each prompt's difficulty p is common to both (B accepts 0.8 p),
    their rounds drawn apart. Returns per-benchmark totals {request: (y, x)} for A and for B."""
    a, b = {}, {}
    for k in range(benchmarks):
        p = rng.beta(2, 3, size=n)
        xa, xb = 1 + rng.poisson(15, size=n), 1 + rng.poisson(15, size=n)
        ya, yb = xa + rng.binomial(gamma * xa, p), xb + rng.binomial(gamma * xb, 0.8 * p)
        a[f"b{k}"] = {f"b{k}/{i}": (int(ya[i]), int(xa[i])) for i in range(n)}
        b[f"b{k}"] = {f"b{k}/{i}": (int(yb[i]), int(xb[i])) for i in range(n)}
    return a, b


def test_paired_comparison_hand_computed_case():
    # One benchmark, two requests. A: (4, 2), (6, 2) -> τ 2.5, influences (4 - 5)/4, (6 - 5)/4 = ∓0.25;
    # B: (3, 2), (3, 1) -> τ 2, influences (3 - 4)/3, (3 - 2)/3 = ∓1/3.
    a = {"g": {"g/0": (4, 2), "g/1": (6, 2)}}
    b = {"g": {"g/0": (3, 2), "g/1": (3, 1)}}
    got = paired_comparison(a, b)
    assert got["tau"] == pytest.approx(2.5) and got["baseline_tau"] == pytest.approx(2.0)
    assert got["difference"] == pytest.approx(0.5) and got["ratio"] == pytest.approx(1.25)
    # Difference: influences -0.25 + 1/3 and 0.25 - 1/3, each ±1/12: SE = sqrt(2 · 2/144) = 1/6.
    assert got["difference_stderr"] == pytest.approx(1 / 6)
    # Ratio: (u_a - 1.25 u_b) / 2 = (-0.25 + 1.25/3) / 2 = ±1/12: SE = sqrt(2 · 2/144) = 1/6.
    assert got["ratio_stderr"] == pytest.approx(1 / 6)
    # One row against itself: no difference and no error, whatever the spread across prompts.
    same = paired_comparison(a, a)
    assert same["difference"] == 0 and same["difference_stderr"] == 0 and same["ratio_stderr"] == 0


def test_paired_comparison_refuses_what_does_not_pair():
    a = {"g": {"g/0": (4, 2), "g/1": (6, 2)}}
    with pytest.raises(ValueError, match="different benchmarks"):
        paired_comparison(a, {"h": a["g"]})
    with pytest.raises(ValueError, match="g: the rows' requests differ"):
        paired_comparison(a, {"g": {"g/0": (4, 2), "g/2": (6, 2)}})
    assert paired_comparison({"g": {"g/0": (4, 2)}}, {"g": {"g/0": (3, 1)}})["difference_stderr"] is None


def test_paired_errors_match_the_spread_of_the_comparison_over_repeated_prompt_sets():
    """The paired errors of the macro difference and ratio match their spread across 1 500 repeated
    prompt sets; the errors added as independent overstate it, since the prompts' difficulty is shared."""
    rng = np.random.default_rng(1)
    diffs, ratios, diff_se, ratio_se, independent = [], [], [], [], []
    for _ in range(1500):
        a, b = _two_rows(rng, n=40)
        got = paired_comparison(a, b)
        diffs.append(got["difference"])
        ratios.append(got["ratio"])
        diff_se.append(got["difference_stderr"])
        ratio_se.append(got["ratio_stderr"])
        errs = [ratio_stderr(*zip(*row[k].values())) for row in (a, b) for k in row]
        independent.append(math.sqrt(sum(e * e for e in errs)) / 2)  # each macro's error, added
    assert np.mean(diff_se) == pytest.approx(np.std(diffs), rel=0.08)
    assert np.mean(ratio_se) == pytest.approx(np.std(ratios), rel=0.08)
    assert np.mean(independent) > 1.5 * np.std(diffs)  # the unpaired error overstates it


def _rows(rng, n: int, scales, benchmarks: int = 2, gamma: int = 7):
    """Drafters on the same prompts: prompt difficulty p shared, drafter j accepting scales[j] · p."""
    rows = [{} for _ in scales]
    for k in range(benchmarks):
        p = rng.beta(2, 3, size=n)
        for row, scale in zip(rows, scales):
            x = 1 + rng.poisson(15, size=n)
            y = x + rng.binomial(gamma * x, scale * p)
            row[f"b{k}"] = {f"b{k}/{i}": (int(y[i]), int(x[i])) for i in range(n)}
    return rows


def test_paired_contrast_is_the_paired_difference_for_two_rows_and_refuses_what_does_not_pair():
    a, b = _two_rows(np.random.default_rng(3), n=20)
    two = paired_contrast([a, b], [1, -1])
    want = paired_comparison(a, b)
    assert two["value"] == pytest.approx(want["difference"])
    assert two["stderr"] == pytest.approx(want["difference_stderr"])
    # A lead that does not change (the same two rows again) has no growth and no error.
    same = paired_contrast([a, b, a, b], [1, -1, -1, 1])
    assert same["value"] == pytest.approx(0) and same["stderr"] == pytest.approx(0)
    with pytest.raises(ValueError, match="2 rows against 3 weights"):
        paired_contrast([a, b], [1, -1, 0])
    with pytest.raises(ValueError, match="the rows' requests differ"):
        paired_contrast([a, {k: dict(list(v.items())[1:]) for k, v in b.items()}], [1, -1])


def test_paired_contrast_error_matches_the_spread_of_a_growing_lead_over_repeated_prompt_sets():
    """How much A's lead over B grows from one setting to another (four rows on the same prompts,
    weights 1, −1, −1, 1): the paired error matches the contrast's spread over 800 prompt sets."""
    rng = np.random.default_rng(2)
    values, errors = [], []
    for _ in range(800):
        rows = _rows(rng, n=40, scales=(1.0, 0.8, 0.95, 0.85))
        got = paired_contrast(rows, [1, -1, -1, 1])
        values.append(got["value"])
        errors.append(got["stderr"])
    assert np.mean(values) > 0  # the lead grows: 0.2 p against 0.1 p
    assert np.mean(errors) == pytest.approx(np.std(values), rel=0.1)
