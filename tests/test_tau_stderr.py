"""τ's standard error over requests (dspark.decoding.uncertainty): a hand-computed case, the
degenerate ones, and a simulation showing it matches the spread of τ over repeated prompt sets."""

import math

import numpy as np
import pytest

from dspark.decoding.engine import tau
from dspark.decoding.uncertainty import mean_stderr, per_request_totals, ratio_stderr, tau_stderr


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
