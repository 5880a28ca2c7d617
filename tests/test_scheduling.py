"""Cost model and verification-length policies (paper §2.1, §3.2.2 / Algorithm 1, §5.2, Appendix A)."""

from __future__ import annotations

import copy
import itertools
import json
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from dspark.core.errors import ConfigError
from dspark.scheduling.cost import CostModel, CostTableError, profile
from dspark.scheduling.policies import (
    POLICIES,
    PROBE_EVERY,
    AcceptanceEstimate,
    AsyncTopK,
    DraftAware,
    Fixed,
    HardwareAware,
    Mtp1,
    PlainProbe,
    Retrospective,
    RoundClock,
    Threshold,
    Truncated,
    _sum,
    admission_order,
    best_length,
    build_policy,
    expected_rates,
    expected_tokens,
    position_counts,
    prefix_survival,
    rows_bucket,
    throughput_path,
)

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def table_from_sps(sps: dict[int, float]) -> CostModel:
    """The paper states SPS(B) (steps/s); the table stores step time in ms."""
    return CostModel({b: 1e3 / s for b, s in sps.items()})


def theta_of(lengths, a: np.ndarray, cost: CostModel) -> float:
    """Θ = (R + Σ_r Σ_{j<=l_r} a_rj) · SPS(R + Σ l_r) for one allocation."""
    lengths = np.asarray(lengths)
    R = a.shape[0]
    tau = R + sum(a[r, : lengths[r]].sum() for r in range(R))
    return tau * cost.sps(R + int(lengths.sum()), R)


def brute_force_best(a: np.ndarray, cost: CostModel) -> float:
    """Max Θ over every contiguous-prefix allocation l ∈ {0..γ}^R (vectorised)."""
    R, G = a.shape
    combos = np.array(list(itertools.product(range(G + 1), repeat=R)))  # [M, R]
    prefix = np.concatenate([np.zeros((R, 1)), np.cumsum(a, axis=1)], axis=1)  # [R, G+1]
    tau = R + prefix[np.arange(R)[None, :], combos].sum(axis=1)
    return float((tau * cost.sps(R + combos.sum(axis=1), R)).max())


def algorithm1_reference(conf: torch.Tensor, cost: CostModel) -> list[int]:
    """Line-by-line scalar transcription of Algorithm 1 (ties: smaller j, then smaller r)."""
    c = conf.double().tolist()
    R = len(c)
    G = len(c[0]) if R else 0
    a = [[math.prod(c[r][: j + 1]) for j in range(G)] for r in range(R)]
    E = sorted(
        ((r, j) for r in range(R) for j in range(G) if a[r][j] > 0),
        key=lambda e: (-a[e[0]][e[1]], e[1], e[0]),
    )
    ell, B, tau = [0] * R, R, float(R)
    best, chosen = R * cost.sps(R, R), [0] * R
    for r, j in E:
        ell[r] = j + 1
        B = R * (1 + max(ell)) if cost.padded else B + 1  # padded: every row as wide as the widest
        tau += a[r][j]
        theta = tau * cost.sps(B, R)
        if theta > best:
            best, chosen = theta, list(ell)
        else:
            break
    return chosen


def residual(pt: np.ndarray, pd: np.ndarray) -> np.ndarray:
    r = np.maximum(pt - pd, 0.0)
    return r / r.sum() if r.sum() > 0 else pt


def emitted_joint(pt1, pd1, pt2, pd2, x1: int, x2: int, ell: int) -> np.ndarray:
    """Exact law of the first two emitted tokens (Y1, Y2) of one request, given its drafts
    (x1, x2) and scheduled length, under standard rejection-sampling verification. Tokens the
    round does not emit come from the next round, which draws them from the target."""
    V = len(pt1)
    out = np.zeros((V, V))
    fresh = np.array([pt1[y] * pt2[y] for y in range(V)])  # Y1 from the target, then Y2 | Y1
    if ell == 0:
        return fresh
    acc1 = min(1.0, pt1[x1] / pd1[x1])
    res1 = residual(pt1, pd1)
    out += (1 - acc1) * res1[:, None] * pt2  # reject x1: correction token, then target
    if ell == 1:
        out[x1] += acc1 * pt2[x1]  # bonus token from the target
    else:
        acc2 = min(1.0, pt2[x1][x2] / pd2[x1][x2])
        out[x1, x2] += acc1 * acc2
        out[x1] += acc1 * (1 - acc2) * residual(pt2[x1], pd2[x1])
    return out


def exact_output_law(policy_fn, inst) -> list[np.ndarray]:
    """Enumerate every joint draft (x_r1, x_r2 for all requests; γ = 2): the scheduler sees
    c_r1 (pre-token) and c_r2 = g_r(x_r1) (Markov confidence head). Returns per-request laws
    of (Y1, Y2)."""
    R, V = len(inst["c1"]), len(inst["pt1"][0])
    laws = [np.zeros((V, V)) for _ in range(R)]
    for xs in itertools.product(range(V), repeat=2 * R):
        x1, x2 = xs[:R], xs[R:]
        p = 1.0
        for r in range(R):
            p *= inst["pd1"][r][x1[r]] * inst["pd2"][r][x1[r]][x2[r]]
        if p == 0:
            continue
        conf = torch.tensor([[inst["c1"][r], inst["g"][r][x1[r]]] for r in range(R)], dtype=torch.float64)
        ell = policy_fn(conf).tolist()
        for r in range(R):
            laws[r] += p * emitted_joint(
                inst["pt1"][r], inst["pd1"][r], inst["pt2"][r], inst["pd2"][r], x1[r], x2[r], ell[r]
            )
    return laws


def target_law(inst, r) -> np.ndarray:
    return inst["pt1"][r][:, None] * inst["pt2"][r]


# ---------------------------------------------------------------------------------------------
# Appendix A: selection bias without early stopping
# ---------------------------------------------------------------------------------------------

APPENDIX_SPS = {1: 1.0, 2: 0.5, 3: 0.45}
A, B_ = 0, 1


def appendix_instance(sps2_pt=None):
    # Second position: the appendix only tracks the first emitted token; any laws do here.
    pt2 = np.array([[0.6, 0.4], [0.2, 0.8]]) if sps2_pt is None else sps2_pt
    return {
        "c1": [0.8],
        "g": [[0.9, 0.0]],  # x1 = A -> c2 = 0.9 ; x1 = B -> c2 = 0
        "pt1": [np.array([0.7, 0.3])],
        "pd1": [np.array([0.5, 0.5])],
        "pt2": [pt2],
        "pd2": [np.array([[0.5, 0.5], [0.5, 0.5]])],
    }


def test_appendix_a_numbers():
    cost = table_from_sps(APPENDIX_SPS)
    a_case1 = torch.tensor([0.8, 0.72], dtype=torch.float64)
    assert throughput_path(a_case1, 1, cost).tolist() == pytest.approx([1.0, 0.9, 1.134])
    # Case 2: a2 = 0 is no candidate (Alg. 1 line 4); Θ2 would be 1.8 * 0.45 = 0.81 anyway.
    rows, j, a = admission_order(torch.tensor([[0.8, 0.0]]))
    assert j.tolist() == [1] and throughput_path(a, 1, cost).tolist() == pytest.approx([1.0, 0.9])
    retro, ha = Retrospective(), HardwareAware()
    assert retro(torch.tensor([[0.8, 0.9]]), cost).tolist() == [2]  # x1 = A: admitted
    assert retro(torch.tensor([[0.8, 0.0]]), cost).tolist() == [0]  # x1 = B: not admitted
    assert ha(torch.tensor([[0.8, 0.9]]), cost).tolist() == [0]  # Θ1 = 0.9 <= Θ0 = 1: stop
    assert ha(torch.tensor([[0.8, 0.0]]), cost).tolist() == [0]
    # The appendix's acceptance rate a1 = Σ min(pt, pd) = 0.8 is consistent with c1.
    assert np.minimum([0.7, 0.3], [0.5, 0.5]).sum() == pytest.approx(0.8)


def test_appendix_a_retrospective_is_biased_hardware_aware_is_not():
    """Appendix A, exactly: R = 1, γ = 2, SPS(1..3) = 1.0, 0.5, 0.45, c1 = 0.8, c2 = 0.9 if
    x1 = A else 0, p_t = (0.7, 0.3), p_d = (0.5, 0.5) over {A, B}.

    Interpretation: B counts the anchor/bonus slot, B = R + Σ l (so SPS(1) is "verify nothing");
    "a1 = 0.8" is the pre-token confidence c1; Y is the first token the round emits: the
    accepted draft, the residual correction on rejection, or the target's own token when l = 0.
    The law is computed by exact enumeration over the drafts and the acceptance coin, and
    cross-checked by a 40k-trial Monte Carlo of the same process.
    """
    cost = table_from_sps(APPENDIX_SPS)
    inst = appendix_instance()
    for policy, want in [(Retrospective(), [0.85, 0.15]), (HardwareAware(), [0.7, 0.3])]:
        law = exact_output_law(lambda c, p=policy: p(c, cost), inst)[0]
        np.testing.assert_allclose(law.sum(axis=1), want, atol=1e-12)

    # Monte Carlo of the retrospective run (the policy depends only on x1, so call it twice).
    rng = np.random.default_rng(0)
    n = 40_000
    retro = Retrospective()
    ell = {x: retro(torch.tensor([[0.8, inst["g"][0][x]]]), cost).item() for x in (A, B_)}
    x1 = rng.choice(2, size=n, p=inst["pd1"][0])
    admitted = np.array([ell[x] for x in x1]) >= 1
    accept = rng.random(n) < np.minimum(1.0, inst["pt1"][0][x1] / inst["pd1"][0][x1])
    fresh = rng.choice(2, size=n, p=inst["pt1"][0])  # l = 0: the target's own token
    corr = rng.choice(2, size=n, p=residual(inst["pt1"][0], inst["pd1"][0]))
    y = np.where(admitted, np.where(accept, x1, corr), fresh)
    freq_a = (y == A).mean()
    se = math.sqrt(0.85 * 0.15 / n)  # ~0.0018
    assert abs(freq_a - 0.85) < 4 * se
    assert abs(freq_a - 0.70) > 40 * se  # the bias is unmistakable, not noise


def test_hardware_aware_lossless_when_it_does_admit():
    """Same instance but SPS(2) = 0.6: Θ1 = 1.08 > Θ0, so Alg. 1 admits x1 always and then
    l = 2 or 1 depending on x1 (via c2). Admission of x1 itself never depends on x1: lossless."""
    cost = table_from_sps({1: 1.0, 2: 0.6, 3: 0.45})
    ha = HardwareAware()
    assert ha(torch.tensor([[0.8, 0.9]]), cost).tolist() == [2]
    assert ha(torch.tensor([[0.8, 0.0]]), cost).tolist() == [1]
    inst = appendix_instance()
    law = exact_output_law(lambda c: ha(c, cost), inst)[0]
    np.testing.assert_allclose(law, target_law(inst, 0), atol=1e-12)


def random_instance(rng, R, V=2):
    def dist(*shape):
        p = rng.dirichlet(np.ones(V) * 0.7, size=shape)
        return p

    return {
        "c1": rng.uniform(0.3, 1.0, size=R).tolist(),
        # Strongly token-dependent continuation confidence: the retrospective trap.
        "g": [rng.permutation([rng.uniform(0.8, 1.0), rng.uniform(0.0, 0.2)]).tolist() for _ in range(R)],
        "pt1": list(dist(R)),
        "pd1": list(dist(R)),
        "pt2": list(dist(R, V)),
        "pd2": list(dist(R, V)),
    }


def random_cost(rng, jagged=False):
    knee = int(rng.integers(1, 6))
    base = float(rng.uniform(5, 20))
    slope = float(rng.uniform(0.2, 3.0)) * base / knee
    return CostModel.analytical(
        base_ms=base,
        knee=knee,
        ms_per_token=slope,
        max_batch=16,
        tile=3 if jagged else None,
        draft_ms=float(rng.uniform(0, 5)),
    )


def test_losslessness_random_instances():
    """Exact enumeration over 2 requests × γ = 2 with token-dependent c2: HardwareAware and
    AsyncTopK (budget from stale rounds) reproduce the target law for every request; the
    retrospective search is caught on some instance (so the harness has teeth)."""
    rng = np.random.default_rng(1)
    retro_violations = 0
    for it in range(60):
        inst = random_instance(rng, R=2)
        cost = random_cost(rng, jagged=it % 2 == 1)
        ha = HardwareAware()
        primed = AsyncTopK(delay=2)
        for _ in range(2):  # two stale rounds fix this round's K before any current draft exists
            primed(torch.rand(2, 2, generator=torch.Generator().manual_seed(it)), cost)

        def async_fn(c, primed=primed, cost=cost):
            return copy.deepcopy(primed)(c, cost)

        for fn in (lambda c, ha=ha, cost=cost: ha(c, cost), async_fn):
            laws = exact_output_law(fn, inst)
            for r in range(2):
                np.testing.assert_allclose(laws[r], target_law(inst, r), atol=1e-12)
        laws = exact_output_law(lambda c, cost=cost: Retrospective()(c, cost), inst)
        retro_violations += any(not np.allclose(laws[r], target_law(inst, r), atol=1e-9) for r in range(2))
    assert retro_violations > 0


# ---------------------------------------------------------------------------------------------
# Algorithm 1: exactness, optimality, ties, edges
# ---------------------------------------------------------------------------------------------


def test_hardware_aware_matches_literal_algorithm1():
    """Vectorised implementation == scalar transcription, incl. jagged costs and exact ties
    (dyadic confidences make products and sums exact)."""
    rng = np.random.default_rng(2)
    ha = HardwareAware()
    for it in range(150):
        R, G = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        if it % 2:
            conf = torch.tensor(rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(R, G)))
        else:
            conf = torch.tensor(rng.uniform(0, 1, size=(R, G)))
        cost = random_cost(rng, jagged=it % 3 == 0)
        assert ha(conf, cost).tolist() == algorithm1_reference(conf, cost), (conf, cost)


def depth_walk_reference(conf: torch.Tensor, cost: CostModel) -> list[int]:
    """Scalar transcription of Algorithm 1 on a padded engine: one step admits every row's next
    position (the width all rows pay anyway), priced T_verify(R(1 + w)) + the drafted block's
    fixed part; stop at the first step that does not beat the previous one."""
    c = conf.double().tolist()
    R, G = len(c), len(c[0])
    a = [[math.prod(c[r][: j + 1]) for j in range(G)] for r in range(R)]
    fixed = float(cost.fixed_ms(R, G)) + cost.readback_ms

    def theta(w):
        tokens = R + sum(a[r][j] for r in range(R) for j in range(w))
        return tokens / (cost.verify_time_ms(R * (1 + w)) + fixed)

    w = 0
    while w < G and theta(w + 1) > theta(w):
        w += 1
    return [w] * R


def test_hardware_aware_on_a_padded_engine():
    """With ``padded`` (rows verified at the widest row's width, as our engines do) Alg. 1 walks
    whole depths: the transcription agrees, the early stop keeps it lossless (exact law), a
    saturated step makes it verify nothing, and where a depth pays for all rows it is verified
    (the per-candidate walk stopped at its first candidate: the whole width for one token)."""
    rng = np.random.default_rng(12)
    ha = HardwareAware()
    for it in range(150):
        R, G = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        conf = torch.tensor(
            rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(R, G)) if it % 2 else rng.uniform(size=(R, G))
        )
        cost = random_cost(rng, jagged=it % 3 == 0)
        cost.padded = True
        assert ha(conf, cost).tolist() == depth_walk_reference(conf, cost), (conf, cost)
    for it in range(30):
        inst, cost = random_instance(rng, R=2), random_cost(rng, jagged=it % 2 == 1)
        cost.padded = True
        laws = exact_output_law(lambda c, cost=cost: ha(c, cost), inst)
        for r in range(2):
            np.testing.assert_allclose(laws[r], target_law(inst, r), atol=1e-12)
    # 8 rows, one confident: a ragged price admits its 4 drafts (4 extra tokens of 12), a padded
    # one would pay 32 tokens for them.
    conf = torch.tensor([[0.99] * 4] + [[0.05] * 4] * 7)
    steep = {8: 4.0, 12: 4.4, 16: 8.0, 40: 30.0}
    assert ha(conf, CostModel(steep)).tolist() == [4] + [0] * 7
    assert ha(conf, CostModel(steep, padded=True)).tolist() == [0] * 8
    # The H200 table at R = 64 (issue 18): one depth costs 0.06 ms for 64 rows' first drafts.
    h200 = CostModel({64: 2.38, 128: 2.44, 256: 2.65, 512: 3.32}, draft_len_ms={7: {64: 2.25}}, padded=True)
    conf = torch.full((64, 7), 0.75)
    assert ha(conf, h200).tolist() == [7] * 64
    assert algorithm1_reference(conf, h200) == [0] * 64  # what it did: 0.35 drafts verified per row


def test_hardware_aware_equals_brute_force_when_unimodal():
    rng = np.random.default_rng(3)
    ha, retro = HardwareAware(), Retrospective()
    unimodal = 0
    n = 200
    for _ in range(n):
        R, G = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        conf = torch.tensor(rng.beta(3, 1, size=(R, G)))
        cost = random_cost(rng)
        a = prefix_survival(conf).numpy()
        best = brute_force_best(a, cost)
        # The sorted path contains the best allocation of every size, so the unconstrained
        # search over it is always the global optimum.
        assert theta_of(retro(conf, cost), a, cost) == pytest.approx(best, rel=1e-12)
        theta = throughput_path(admission_order(conf)[2], R, cost).numpy()
        d = np.diff(theta)
        first_drop = np.argmax(d <= 0) if (d <= 0).any() else len(d)
        if not (d[first_drop:] > 0).any():
            unimodal += 1
            assert theta_of(ha(conf, cost), a, cost) == pytest.approx(best, rel=1e-12)
    # Θ = concave τ / convex roofline time is quasi-concave: nearly every instance qualifies.
    assert unimodal >= 0.9 * n


def test_hardware_aware_can_stop_at_a_cliff():
    """Jagged SPS (§5.2): Alg. 1 stops before a cliff that a global search would cross."""
    # Flat up to B = 4, a 2x cliff at B = 5, then flat (extrapolation keeps the last slope, 0).
    cost = CostModel({4: 10.0, 5: 20.0, 12: 20.0})
    conf = torch.full((4, 4), 0.99, dtype=torch.float64)
    a = prefix_survival(conf).numpy()
    ha, retro = HardwareAware()(conf, cost), Retrospective()(conf, cost)
    assert ha.sum().item() == 0 and retro.sum().item() == 16
    assert theta_of(retro, a, cost) > 1.5 * theta_of(ha, a, cost)


def test_admission_order_ties():
    rows, j, a = admission_order(torch.tensor([[1.0, 1.0], [1.0, 0.5]]))
    assert list(zip(rows.tolist(), j.tolist())) == [(0, 1), (1, 1), (0, 2), (1, 2)]
    # Cross-row tie a[0,2] == a[1,1] == 0.5: the smaller position goes first.
    rows, j, a = admission_order(torch.tensor([[1.0, 0.5], [0.5, 0.1]]))
    assert list(zip(rows.tolist(), j.tolist())) == [(0, 1), (1, 1), (0, 2), (1, 2)]
    # Within-row tie (c = 1) and dead prefixes dropped.
    rows, j, a = admission_order(torch.tensor([[0.5, 1.0, 0.0], [0.0, 1.0, 1.0]]))
    assert list(zip(rows.tolist(), j.tolist())) == [(0, 1), (0, 2)]
    assert a.tolist() == [0.5, 0.5]


def test_hardware_aware_ties_and_budget():
    ha = HardwareAware()
    conf = torch.tensor([[1.0, 1.0], [1.0, 0.5]])
    # SPS flat to B = 5, halves at 6: Θ = 2, 3, 4, 5 (x1000) then 2.75 -> admit three.
    cost = CostModel({2: 1.0, 5: 1.0, 6: 2.0})
    assert ha(conf, cost).tolist() == [2, 1]
    # One token fits before the cliff: the tie (0,1)/(1,1) goes to the smaller row.
    cost = CostModel({2: 1.0, 3: 1.0, 4: 2.0})
    assert ha(conf, cost).tolist() == [1, 0]
    # Θ equal to Θ_best stops (strict >): exact tie from a doubled step time with τ: 2 -> 4.
    cost = CostModel({2: 1.0, 3: 1.5, 4: 2.0})  # Θ: 2000, 2000 -> stop
    assert ha(conf, cost).tolist() == [0, 0]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_edges_empty_batch_and_zero_gamma(name):
    cost = CostModel.analytical(knee=8)
    pol = build_policy(name)
    out = pol(torch.zeros(0, 4), cost)
    assert out.shape == (0,) and out.dtype == torch.long
    pol.reset()
    out = pol(torch.zeros(3, 0), cost)
    assert out.tolist() == [0, 0, 0] and out.dtype == torch.long


def test_lengths_are_prefix_and_device_dtype():
    rng = np.random.default_rng(4)
    cost = CostModel.analytical(knee=32, draft_ms=2.0)
    conf = torch.tensor(rng.uniform(0.2, 1.0, size=(64, 8)), dtype=torch.float32)
    for name in POLICIES:
        out = build_policy(name)(conf, cost)
        assert out.dtype == torch.long and out.shape == (64,)
        assert int(out.min()) >= 0 and int(out.max()) <= 8


def test_large_batch_is_fast_enough():
    import time

    cost = CostModel.analytical(knee=512, max_batch=8192)
    conf = torch.rand(256, 16, generator=torch.Generator().manual_seed(0))
    ha = HardwareAware()
    t0 = time.perf_counter()
    for _ in range(20):
        ha(conf, cost)
    assert (time.perf_counter() - t0) / 20 < 0.02  # R·γ = 4096 candidates; ~1 ms here


def test_policies_need_cost_and_valid_confidences():
    with pytest.raises(ValueError, match="CostModel"):
        HardwareAware()(torch.rand(2, 3), None)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        HardwareAware()(torch.tensor([[0.5, 1.5]]), CostModel.analytical())
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Threshold(0.5)(torch.tensor([[0.5, float("nan")]]))
    with pytest.raises(ValueError, match="R, gamma"):
        Threshold(0.5)(torch.rand(3))


# ---------------------------------------------------------------------------------------------
# simple policies and the registry
# ---------------------------------------------------------------------------------------------


def test_fixed_mtp1_threshold():
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.4, 1.0, 1.0], [0.9, 0.5, 1.0]])
    assert Fixed(2)(conf).tolist() == [2, 2, 2]
    assert Fixed()(conf).tolist() == [3, 3, 3]
    assert Fixed(0)(conf).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="only 3"):
        Fixed(4)(conf)
    assert Mtp1()(conf).tolist() == [1, 1, 1]
    # a = [[.9, .81, .729], [.4, .4, .4], [.9, .45, .45]]
    assert Threshold(0.5)(conf).tolist() == [3, 0, 1]
    assert Threshold(0.8)(conf).tolist() == [2, 0, 1]
    assert Threshold(0.0)(conf).tolist() == [3, 3, 3]
    assert Threshold(1.0)(torch.tensor([[1.0, 1.0, 0.99]])).tolist() == [2]
    with pytest.raises(ValueError):
        Threshold(1.5)


def test_build_policy_registry():
    assert set(POLICIES) == {
        "fixed", "mtp1", "threshold", "hardware_aware", "async_topk", "draft_aware", "retrospective"
    }  # fmt: skip
    assert isinstance(build_policy("Hardware-Aware"), HardwareAware)
    # A policy config takes the YAML keys users type (conf/policy/threshold.yaml: `threshold:`).
    p = build_policy(OmegaConf.create({"name": "threshold", "threshold": 0.3}))
    assert isinstance(p, Threshold) and p.threshold == 0.3 and p.name == "threshold"
    assert build_policy({"name": "async_topk", "delay": 3, "cost_table": None}).delay == 3
    assert build_policy({"name": "fixed", "gamma": 4}).gamma == 4
    assert build_policy("fixed_2").gamma == 2 and build_policy("threshold_0.25").threshold == 0.25
    with pytest.raises(ConfigError, match="unknown policy 'oracle'"):
        build_policy("oracle")
    takes = r"policy threshold: it takes \['threshold', 'window'\], not \['gamma'\]"
    with pytest.raises(ConfigError, match=takes):
        build_policy({"name": "threshold", "gamma": 3})
    with pytest.raises(ConfigError, match=r"threshold must be in \[0, 1\]"):
        build_policy("threshold_1.5")
    # Defaults fill what a spec leaves out, for the policies that take them only.
    defaults = {"threshold": 0.7, "delay": 5, "check": False}
    assert build_policy("threshold", defaults=defaults).threshold == 0.7
    assert build_policy("threshold_0.1", defaults=defaults).threshold == 0.1
    assert build_policy("mtp1", defaults=defaults).gamma == 1
    assert build_policy("hardware_aware", defaults=defaults).check is False


def test_a_policy_name_can_carry_arguments():
    """``<name>:<argument>=<value>``: a variant to compare beside the default under one name (e2e's
    ``--policies``); its values read as ints, floats or booleans, and override the defaults."""
    p = build_policy(
        "draft_aware:probe_every=128:plain_margin=0.02:round_clock=false", defaults={"probe_every": 7}
    )
    assert (p.probe_every, p.plain_margin, p.clock) == (128, 0.02, None)
    assert build_policy("threshold_0.3:window=2").window == 2
    with pytest.raises(ConfigError, match="'probe_every' is not <argument>=<value>"):
        build_policy("draft_aware:probe_every")
    with pytest.raises(ConfigError, match=r"it takes .*, not \['foo'\]"):
        build_policy("draft_aware:foo=1")
    with pytest.raises(ConfigError, match="probe_every must be >= 0"):
        build_policy("hardware_aware:probe_every=-1")
    with pytest.raises(ConfigError, match="gamma given twice"):
        build_policy("fixed_3:gamma=2")


def test_policies_declare_what_they_need():
    """The engine and the stages ask the policy object; a wrapper answers for what it wraps."""
    need = {n: (build_policy(n).needs_confidence, build_policy(n).needs_cost) for n in POLICIES}
    assert need == {
        "fixed": (False, False),
        "mtp1": (False, False),
        "threshold": (True, False),
        "hardware_aware": (True, True),
        "async_topk": (True, True),
        "draft_aware": (False, True),
        "retrospective": (True, True),
    }
    assert [n for n in POLICIES if not build_policy(n).lossless] == ["retrospective"]
    assert not AsyncTopK(delay=0).lossless  # the degenerate delay is the retrospective search
    cut = build_policy("async_topk", gamma=3, block=5)
    assert isinstance(cut, Truncated) and isinstance(cut.base, AsyncTopK)
    assert (cut.needs_confidence, cut.needs_cost, cut.lossless) == (True, True, True)
    assert cut.name == "async_topk[:3]"
    assert build_policy("fixed", gamma=5, block=5).gamma is None  # nothing to cut
    with pytest.raises(ConfigError, match="γ=6 exceeds the draft length gamma=5"):
        build_policy("fixed_6", gamma=5)


# ---------------------------------------------------------------------------------------------
# async top-K (§5.2)
# ---------------------------------------------------------------------------------------------


def test_async_topk_budget_comes_from_two_rounds_ago():
    # Knee at B = R: every admitted token costs 10% of a step.
    cost = CostModel.analytical(base_ms=10.0, knee=4, ms_per_token=1.0, max_batch=64)
    R, G = 4, 4
    high = torch.full((R, G), 0.97)
    low = torch.full((R, G), 0.02)
    mid = torch.tensor([[0.9, 0.8, 0.6, 0.3]] * R)
    k = {
        name: Retrospective()(c, cost).sum().item()
        for name, c in [("high", high), ("low", low), ("mid", mid)]
    }
    assert k == {"high": 16, "low": 0, "mid": 8}  # distinct, so the sequence below proves something

    pol = AsyncTopK(delay=2, fallback=5)
    seq = [("high", high), ("low", low), ("mid", mid), ("mid", mid), ("high", high)]
    used = []
    for _, c in seq:
        used.append(pol(c, cost).sum().item())
    # Rounds 0, 1: fallback; round t >= 2: the budget searched on round t - 2's confidences,
    # clamped to the candidates alive now.
    assert used[:2] == [5, 5]
    assert used[2] == min(k["high"], R * G)
    assert used[3] == k["low"]
    assert used[4] == k["mid"]
    assert used[2] != k["mid"] and used[3] != k["mid"]  # not the current round's own budget

    pol.reset()
    assert pol.pending == ()
    assert pol(mid, cost).sum().item() == 5


def test_async_topk_admits_current_top_k():
    cost = CostModel.analytical(knee=4)
    pol = AsyncTopK(delay=1, fallback=3)
    cur = torch.tensor([[0.9, 0.2, 0.9], [0.95, 0.95, 0.1], [0.3, 1.0, 1.0]])
    # a: [.9 .18 .162] [.95 .9025 .09] [.3 .3 .3] -> top 3: (1,1) .95, (1,2) .9025, (0,1) .9
    assert pol(cur, cost).tolist() == [1, 2, 0]
    # Fallback None = verify everything alive (Fixed γ).
    assert AsyncTopK(delay=2)(cur, cost).tolist() == [3, 3, 3]


def test_async_topk_delay_zero_is_retrospective():
    rng = np.random.default_rng(5)
    for _ in range(20):
        conf = torch.tensor(rng.uniform(0, 1, size=(5, 4)))
        cost = random_cost(rng, jagged=True)
        assert AsyncTopK(delay=0)(conf, cost).tolist() == Retrospective()(conf, cost).tolist()


# ---------------------------------------------------------------------------------------------
# draft-aware scheduling: how many positions to draft, decided before drafting
# ---------------------------------------------------------------------------------------------


def test_draft_aware_estimates_acceptance_from_completed_rounds():
    pol = DraftAware(memory=2)  # each try a position gets halves the weight of its older ones
    assert pol.acceptance(3).tolist() == [1.0, 1.0, 1.0]  # optimistic before any round
    # Four rows verified 3 drafts: accepted 0, 1, 3, 3. Position 1 reached by 4, accepted by 3;
    # position 2 reached by 3, accepted by 2; position 3 reached by 2, accepted by 2.
    pol.observe_round(np.array([3, 3, 3, 3]), np.array([0, 1, 3, 3]))
    np.testing.assert_allclose(pol.acceptance(4), [(3 + 1) / (4 + 1), (2 + 1) / (3 + 1), 1.0, 1.0])
    # Older tries weigh less, position by position: two new tries of position 1 leave its old
    # evidence a quarter of its weight, and positions 2 and 3, not reached, keep theirs. A plain
    # round (nothing verified) says nothing about acceptance and leaves the estimate alone: a load
    # that declined to draft does not drift back to optimism and redraft for nothing (issue 18:
    # R = 256 kept re-measuring).
    pol.observe_round(np.array([1, 1]), np.array([0, 0]))
    want = [(0.75 + 1) / (1 + 2 + 1), (2 + 1) / (3 + 1), (2 + 1) / (2 + 1)]
    np.testing.assert_allclose(pol.acceptance(3), want)
    for _ in range(50):
        pol.observe_round(np.array([0, 0]), np.array([0, 0]))
    np.testing.assert_allclose(pol.acceptance(3), want)
    pol.reset()  # a new generate: what it learned about the drafter stays
    np.testing.assert_allclose(pol.acceptance(3), want)
    pol.forget()
    assert pol.acceptance(2).tolist() == [1.0, 1.0]


def test_acceptance_memory_counts_tries_not_rounds():
    """A deep position reached in one round of ten keeps its evidence over the rounds that do not
    reach it: after 2 000 rounds of one row accepting each position with probability 0.6, every
    position's estimate is within a few points of 0.6. A per-round decay kept ~1 try of position 5
    there, and its estimate strayed with each one."""
    rng = np.random.default_rng(0)
    est = AcceptanceEstimate(memory=256)
    for _ in range(2000):
        accepted = np.minimum(rng.geometric(0.4, 1) - 1, 5)
        est.observe(np.array([5]), accepted)
    assert est._tries[4] > 100  # position 5: reached in 0.6 ** 4 ≈ 13 % of the rounds
    np.testing.assert_allclose(est.rates(5), 0.6, atol=0.06)
    with pytest.raises(ValueError, match="memory"):
        AcceptanceEstimate(memory=0.5)
    for policy in (DraftAware, HardwareAware):  # the clocks' decay is checked without a round clock too
        with pytest.raises(ValueError, match="decay"):
            policy(decay=1.0, round_clock=False)
        assert policy(memory=64).memory == 64


def test_acceptance_counts_match_the_per_position_table():
    """``AcceptanceEstimate.observe`` counts from two histograms what the [rows, positions] table of
    reached and accepted positions says (ragged lengths, rows accepting all, none, or some)."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        rows, gamma = int(rng.integers(1, 40)), int(rng.integers(1, 9))
        lengths = rng.integers(0, gamma + 1, rows)
        accepted = np.minimum(rng.integers(0, gamma + 1, rows), lengths)
        est = AcceptanceEstimate(memory=1)  # this round alone
        est.observe(lengths, accepted)
        j = np.arange(1, gamma + 1)[None, :]
        reached = (j <= lengths[:, None]) & (accepted[:, None] >= j - 1)
        tries, hits = reached.sum(0), (reached & (accepted[:, None] >= j)).sum(0)
        n = int(lengths.max(initial=0))
        np.testing.assert_allclose(est.rates(gamma)[:n], ((hits + 1.0) / (tries + 1.0))[:n])


def _numpy_at_least(values: np.ndarray, n: int) -> np.ndarray:
    """``#(values >= j)`` for ``j = 1..n``, as the policies counted it with numpy."""
    counts = np.bincount(np.minimum(values, n).astype(np.int64), minlength=n + 1)
    return counts[::-1].cumsum()[::-1][1:]


def _rounds(rng, count: int):
    """Random rounds (lengths, accepted): every row verifying one length (a whole draft, a padded
    walk) or ragged ones, accepting geometrically, now and then more than verified or nothing."""
    for _ in range(count):
        rows, gamma = int(rng.integers(0, 40)), int(rng.integers(0, 9))
        lengths = np.full(rows, gamma) if rng.random() < 0.5 else rng.integers(0, gamma + 1, rows)
        accepted = np.minimum(rng.geometric(0.3, rows) - 1, lengths)
        if rng.random() < 0.1:
            accepted = rng.integers(0, gamma + 3, rows)
        yield lengths, accepted


def test_position_counts_match_the_numpy_histograms():
    """``position_counts`` (one histogram where every row verified the same length) counts what
    the two clipped histograms of min(ℓ, n) and min(ℓ, n + 1) counted, for any n; the estimate
    counts ``Σ accepted`` on the way."""
    rng = np.random.default_rng(5)
    for lengths, accepted in _rounds(rng, 2000):
        assert AcceptanceEstimate().observe(lengths, accepted) == int(accepted.sum())
        for n in (0, 3, int(lengths.max(initial=0)), 9):
            hits, tries = position_counts(lengths, accepted, n)
            assert hits.dtype == tries.dtype == np.int64
            assert hits.tolist() == _numpy_at_least(np.minimum(lengths, accepted), n).tolist()
            assert tries.tolist() == _numpy_at_least(np.minimum(lengths, accepted + 1), n).tolist()


def test_acceptance_estimate_matches_the_numpy_update_to_the_bit():
    """The estimate kept in Python lists fades and counts as the numpy arrays did, to the bit (its
    fade table comes from numpy's power, whose last ulp differs from libm's for some counts), and
    its expected accepted drafts are numpy's cumprod and cumsum of the rates, to the bit."""

    class Reference:  # the numpy estimate the lists replace
        def __init__(self, memory):
            self.memory, self.hits, self.tries = memory, np.zeros(0), np.zeros(0)

        def observe(self, lengths, accepted):
            longest = int(lengths.max(initial=0))
            if longest == 0:
                return
            grow = max(longest - self.hits.size, 0)
            self.hits, self.tries = (
                np.concatenate([self.hits, np.zeros(grow)]),
                np.concatenate([self.tries, np.zeros(grow)]),
            )
            n = self.hits.size
            hits = _numpy_at_least(np.minimum(lengths, accepted), n)
            tries = _numpy_at_least(np.minimum(lengths, accepted + 1), n)
            keep = (1.0 - 1.0 / self.memory) ** tries
            self.hits, self.tries = keep * self.hits + hits, keep * self.tries + tries

        def rates(self, gamma):
            hits, tries = np.zeros(gamma), np.zeros(gamma)
            n = min(gamma, self.hits.size)
            hits[:n], tries[:n] = self.hits[:n], self.tries[:n]
            return (hits + 1.0) / (tries + 1.0)

    rng = np.random.default_rng(11)
    for memory in (1.0, 3.0, 256.0):
        est, ref = AcceptanceEstimate(memory), Reference(memory)
        for lengths, accepted in _rounds(rng, 1500):
            accepted = np.minimum(accepted, lengths)  # the estimate's rounds are real ones
            est.observe(lengths, accepted)
            ref.observe(lengths, accepted)
            gamma = int(rng.integers(0, 10))
            assert est.rates(gamma).tolist() == ref.rates(gamma).tolist()
            want = np.concatenate([[0.0], np.cumsum(np.cumprod(ref.rates(gamma)))])
            assert est.accepted(gamma) == want.tolist()


def test_expected_tokens_and_best_length_match_numpy_to_the_bit():
    rng = np.random.default_rng(2)
    for _ in range(2000):
        c, rows = rng.random(int(rng.integers(0, 9))), int(rng.integers(1, 300))
        want = rows * (1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(c))]))
        assert expected_tokens(c, rows).tolist() == want.tolist()
        rates = np.round(rng.random(c.size + 1), 1)  # ties: the first of equals, as np.argmax
        m = int(np.argmax(rates))
        assert best_length(rates, 0.1) == (m if m == 0 or rates[m] >= 1.1 * rates[0] else 0)


def test_round_clock_prices_as_the_numpy_formula_to_the_bit():
    """The clock's Python lists price each drafted length as the numpy version did: measured /
    priced where timed (``min_timed`` rounds, not stale), else the mean ratio of the timed ones
    (added in numpy's order), through rounds of several row buckets and lengths going stale."""
    cost = CostModel({1: 1.0, 64: 1.5, 4096: 40.0}, draft_ms={1: 0.5, 256: 0.9})
    rng = np.random.default_rng(7)
    clock = RoundClock(decay=0.8, min_timed=2, stale_after=6)
    for _ in range(3000):
        rows, drafted = int(rng.choice([3, 4, 60, 200])), int(rng.integers(0, 8))
        clock.observe(rows, drafted, float(rng.lognormal(0.0, 0.3)), cost)
        rows, gamma = int(rng.choice([3, 4, 60, 200])), int(rng.integers(0, 9))
        stats = clock._stats.get(rows_bucket(rows))
        ratio, timed = np.ones(gamma + 1), np.zeros(gamma + 1, dtype=bool)
        if stats is not None:
            sums, weights, rounds, last = (np.array(column[: gamma + 1]) for column in stats[:4])
            n = sums.size
            timed[:n] = (rounds >= 2) & (clock._bucket_rounds[rows_bucket(rows)] - last <= 6)
            if timed.any():
                own = sums[timed[:n]] / weights[timed[:n]]
                ratio[:] = own.sum() / own.size
                ratio[timed] = own
        assert clock.times(rows, gamma, cost).tolist() == (cost.round_times(rows, gamma) * ratio).tolist()
        assert [clock.timed(rows, m) for m in range(gamma + 1)] == timed.tolist()
    assert all(_sum(list(v)) == np.sum(v) for v in (rng.random(k) for k in range(12) for _ in range(200)))


def test_whole_draft_lengths_are_made_once_per_shape():
    """A policy that verifies the whole draft hands back one tensor per shape and device (its
    callers only read it), not a fill a round; made in an engine's inference mode, it is a plain
    tensor all the same."""
    cost = CostModel({1: 1.0, 64: 1.0})
    for pol in (DraftAware(), HardwareAware()):
        pol.draft_length(4, 3, cost)  # HardwareAware: nothing to save, so no walk
        with torch.inference_mode():
            first = pol.lengths(torch.rand(4, 3), cost)
        assert first.tolist() == [3, 3, 3, 3] and first.dtype == torch.long and not first.is_inference()
        assert pol.lengths(torch.rand(4, 3), cost) is first
        assert pol.lengths(torch.rand(2, 0), cost).tolist() == [0, 0]
        with pytest.raises(ValueError, match="confidences"):
            pol.lengths(torch.rand(4), cost)


def _rates_by_hand(c: list[float], R: int, cost: CostModel) -> list[float]:
    a = np.cumprod(c)
    return [R * (1 + a[:m].sum()) / cost.round_time(R, m) for m in range(len(c) + 1)]


def test_draft_aware_drafts_what_pays_at_this_load():
    """Θ(γ_d) = R(1 + Σ_{j<=γ_d} a_j) / (T_draft(R, γ_d) + T_verify(R(γ_d+1)) + overhead), a plain
    round costing T_verify(R) alone: a cheap step at low load drafts the whole block, a saturated
    target or a costly draft step declines to draft, and in between a shorter draft wins."""
    # Memory-bound to B = 64 (4 ms), then 0.1 ms per token; drafting costs 1 ms + 0.1 ms per position.
    verify = {1: 4.0, 64: 4.0, 4096: 4.0 + 0.1 * (4096 - 64)}
    draft = {m: {1: 1.0 + 0.1 * m, 256: 1.0 + 0.1 * m} for m in range(1, 6)}
    cost = CostModel(verify, draft_len_ms=draft)
    pol = DraftAware()
    for _ in range(20):  # every position accepted 70% of the time it is reached
        pol.observe_round(np.full(1000, 5), np.random.default_rng(0).geometric(0.3, 1000).clip(max=6) - 1)
    c = pol.acceptance(5)
    assert np.all(np.abs(c - 0.7) < 0.05)
    plans = {R: pol.draft_length(R, 5, cost) for R in (1, 8, 16, 32, 256)}
    assert plans[1] == 5 and plans[256] == 0 and 0 < plans[16] < 5, plans
    for R, m in plans.items():
        rates = _rates_by_hand(list(c), R, cost)
        assert m == int(np.argmax(rates)) and pol.expected_rates(R, 5, cost) == pytest.approx(rates)
    # The per-round overhead is charged to drafting rounds only: enough of it stops drafting.
    heavy = CostModel(verify, draft_len_ms=draft, overhead_ms=20.0)
    assert pol.draft_length(1, 5, heavy) == 0
    # Every row verifies the whole draft; the width is known before the confidences exist.
    assert pol.lengths(torch.rand(3, 2), cost).tolist() == [2, 2, 2] and pol.width(2) == 2
    with pytest.raises(ValueError, match="CostModel"):
        pol.draft_length(4, 5, None)
    # Measured rounds (engine_sps --rounds) price a whole-draft round where they exist: if the
    # engine runs a round of 16 rows at the same cost whatever it drafts, the steps' sum (which
    # found a shorter draft cheaper) no longer decides, and the whole block is drafted.
    flat = {m: {1: 6.0, 256: 6.0} for m in range(1, 6)} | {0: {1: 4.0, 256: 4.0}}
    measured = CostModel(verify, draft_len_ms=draft, round_len_ms=flat)
    assert pol.draft_length(16, 5, measured) == 5
    assert measured.round_time(16, 3) == pytest.approx(6e-3) and measured.round_time(16, 0) == pytest.approx(
        4e-3
    )


@pytest.mark.parametrize("policy", ["draft_aware", "hardware_aware"])
def test_load_aware_policies_draft_only_past_a_margin_over_plain_decoding(policy):
    """A round drafts only where the model expects the draft to beat a plain round by
    ``plain_margin`` (default 5 %): near break-even the gain is within the model's error. One
    position accepted half the time (1.5 tokens a row) in a 2.9 ms round against 2.0 ms plain: +3.4 %,
    a plain round; in 2.7 ms: +11 %, a draft; with no margin the bare argmax."""

    def cost(drafting_ms):
        return CostModel(
            {1: 1.0, 4096: 1.0}, round_len_ms={0: {1: 2.0, 256: 2.0}, 1: {1: drafting_ms, 256: drafting_ms}}
        )

    def plan(drafting_ms, **kw):
        pol = build_policy(policy, defaults={"check": False, "round_clock": False, **kw})
        pol.observe_round(np.full(1000, 1), np.resize([0, 1], 1000))  # accepted half the time
        return pol.draft_length(256, 1, cost(drafting_ms))

    assert (plan(2.9), plan(2.7)) == (0, 1)
    assert plan(2.9, plain_margin=0.0) == 1 and plan(2.7, plain_margin=0.2) == 0
    assert (
        best_length(np.array([1.0, 1.2, 1.3]), 0.25) == 2 and best_length(np.array([1.0, 1.2, 1.3]), 0.4) == 0
    )
    with pytest.raises(ValueError, match="plain_margin"):
        build_policy(policy, defaults={"plain_margin": -0.1})
    # The rounds' clock applies the same rule to the rates it prices.
    clock = RoundClock()
    assert clock.choose(np.array([256.0, 384.0]), 256, cost(2.9), 0.05) == 0
    assert clock.choose(np.array([256.0, 384.0]), 256, cost(2.9)) == 1


def _one_position_rounds(pol, cost: CostModel, n: int, accepted: np.ndarray) -> list[int]:
    """The lengths ``pol`` plans over ``n`` rounds of 256 rows drafting at most one position, the rows
    where ``accepted`` holds accepting it; each round reported before the next is planned."""
    drafted = []
    for _ in range(n):
        m = pol.draft_length(256, 1, cost)
        drafted.append(m)
        pol.observe_round(np.full(256, m), (accepted & (m > 0)).astype(np.int64))
    return drafted


@pytest.mark.parametrize("policy", ["draft_aware", "hardware_aware"])
def test_a_long_plain_streak_ends_in_a_probe_that_can_bring_drafting_back(policy):
    """Issue 18's H100 run (2026-12-06, T = 0, R = 256): both load-aware schedulers went plain for
    one of their three runs where drafting paid 7 % at the load. Only drafting rounds teach the
    acceptance estimate, so a plain streak begun on a low estimate never ends by itself. Here one
    drafted position pays 10 % at its true acceptance (0.6) and loses at 0.2: after unlucky rounds
    at 0.2 the policy goes plain; without probes it stays plain, with ``probe_every = 16`` the 16th
    plain round in a row starts a probe (two rounds drafting the length drafted last) that
    re-measures the position, and drafting resumes. Where drafting does not pay, the probes are all
    it drafts, each fruitless one doubling the wait for the next."""
    drafting = 1.6 * 1.6 / 1.1  # ms: 1.6 tokens a row at 0.6, 10 % above a plain round's rate
    rounds = {0: {1: 1.6, 256: 1.6}, 1: {1: drafting, 256: drafting}}
    cost = CostModel({1: 1.0, 4096: 1.0}, round_len_ms=rounds)
    true, unlucky = np.arange(256) % 5 < 3, np.arange(256) % 5 < 1  # accepted 60 % and 20 % of the time

    def run(pol, n, accepted):
        return _one_position_rounds(pol, cost, n, accepted)

    def unlucky_policy(every):
        """The policy and the plain rounds it has run since the estimate fell below the margin."""
        pol = build_policy(policy, defaults={"check": False, "round_clock": False, "probe_every": every})
        assert run(pol, 4, true) == [1] * 4  # drafting pays
        bad = run(pol, 3, unlucky)  # rounds at 0.2: the estimate falls below the margin
        assert bad[-1] == 0
        return pol, len(bad) - 1 - max(i for i, m in enumerate(bad) if m)

    pol, _ = unlucky_policy(0)
    assert run(pol, 100, true) == [0] * 100  # stuck: nothing drafts to learn otherwise
    pol, plain = unlucky_policy(16)
    back = run(pol, 64, true)
    probe = 16 - plain - 1  # the 16th plain round in a row
    assert back[:probe] == [0] * probe and back[probe : probe + 2] == [1, 1]
    assert all(back[probe:])  # drafting for the rest of the run
    pol, plain = unlucky_policy(16)
    where_it_does_not_pay = [0] * 15 + [1, 1] + [0] * 31 + [1, 1] + [0] * 14
    assert [0] * plain + run(pol, 64 - plain, unlucky) == where_it_does_not_pay
    with pytest.raises(ValueError, match="probe_every"):
        build_policy(policy, defaults={"probe_every": -1})


@pytest.mark.parametrize("policy", ["draft_aware", "hardware_aware"])
def test_keep_margin_keeps_a_drafting_policy_drafting_near_break_even(policy):
    """Once the plan drafts, ``keep_margin`` stands for ``plain_margin``: here one drafted position
    is expected 3 % above a plain round's rate at its true acceptance (0.6). With the default (the
    5 % margin both ways) the policy stops drafting once it has measured that; with ``keep_margin=0``
    it drafts on, while a policy that is plain at that estimate stays plain (entering still needs
    5 %), and a probe's draft does not count as the plan's."""
    drafting = 1.6 * 1.6 / 1.03  # ms: 1.6 tokens a row at 0.6, 3 % above a plain round's rate
    cost = CostModel(
        {1: 1.0, 4096: 1.0}, round_len_ms={0: {1: 1.6, 256: 1.6}, 1: {1: drafting, 256: drafting}}
    )
    true = np.arange(256) % 5 < 3  # accepted 60 % of the time

    def run(pol, n):
        return _one_position_rounds(pol, cost, n, true)

    def build(**kw):
        return build_policy(policy, defaults={"check": False, "round_clock": False, "probe_every": 0, **kw})

    assert run(build(), 12)[-4:] == [0] * 4  # measured 3 %, below the margin: plain
    assert run(build(keep_margin=0.0), 12) == [1] * 12  # drafting from the prior on, and kept
    plain = build(keep_margin=0.0)
    plain.observe_round(np.full(256, 1), true.astype(np.int64))  # measured before its first plan
    assert run(plain, 12) == [0] * 12  # 3 % does not start drafting
    probed = build(keep_margin=0.0, probe_every=4)
    probed.observe_round(np.full(256, 1), true.astype(np.int64))
    assert run(probed, 12) == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]  # a probe's draft: not the plan's
    assert build().keep_margin == build().plain_margin == 0.05
    with pytest.raises(ConfigError, match="keep_margin must be a finite share"):
        build(keep_margin=-0.1)


LOCK_COST = CostModel(
    {1: 1.0, 4096: 1.0},
    round_len_ms={0: {1: 1.0, 128: 1.1}, 1: {1: 1.5, 128: 1.6}, 2: {1: 1.6, 128: 1.7}, 3: {1: 1.7, 128: 1.8}},
)


@pytest.mark.parametrize("policy", ["draft_aware", "hardware_aware"])
def test_lock_replay_shows_a_plain_lock_and_the_probe_ending_it(policy, tmp_path, capsys):
    """``lock_replay`` (issue 18's T = 0, R = 256 run, replayed): four rounds at 0.3 of the
    acceptance at the start of run 1 leave the policy plain for the rest of that run without probes
    (it drafts again only in the drain); with a probe after 32 plain rounds it drafts again at once.
    Run 0, before the dip, drafts alike either way."""
    from dspark.scheduling.lock_replay import main, replay

    kw = dict(rows=128, requests=384, runs=3, acceptance=(0.6, 0.64, 0.58), dip_rounds=4, dip_factor=0.3)
    stuck, probed = (replay(LOCK_COST, policy, probe_every=every, **kw) for every in (0, 32))
    assert stuck[1]["plain_at_load"] > 0.8 * stuck[1]["rounds"] and stuck[1]["drafting_at_load"] < 8
    assert probed[1]["plain_at_load"] <= 32 and probed[1]["drafting_at_load"] > 100
    assert stuck[0] == probed[0] and stuck[0]["plain_at_load"] == 0
    assert probed[1]["ms"] < 0.85 * stuck[1]["ms"]  # the simulated run's time
    LOCK_COST.save(tmp_path / "cost.json")
    policies = f"{policy},{policy}:keep_margin=0,{policy}:probe_every=64,fixed_3"
    args = ["--cost-table", str(tmp_path / "cost.json"), "--policy", policies,
            "--rows", "128", "--requests", "384", "--runs", "2", "--acceptance", "0.6,0.64,0.58",
            "--dip-rounds", "4", "--dip-factor", "0.3", "--probe-every", "0,32",
            "--out", str(tmp_path / "replay.json")]  # fmt: skip
    report = main(args)
    assert json.loads((tmp_path / "replay.json").read_text())["replays"] == report["replays"]
    entries = [(e["policy"], e["probe_every"]) for e in report["replays"]]
    variant = f"{policy}:keep_margin=0"  # a variant replays beside the policy
    assert entries == [
        (policy, 0),
        (policy, 32),
        (variant, 0),
        (variant, 32),
        (f"{policy}:probe_every=64", 64),  # a variant that names its probe replays under that one alone
        ("fixed_3", 0),
    ]  # fixed: no probes
    assert report["replays"][1]["runs"] == probed[:2] and f"| {policy} | 32 | 1 |" in capsys.readouterr().out
    bad_args = (["--probe-every", "0,-1"], ["--probe-every", "x"], ["--acceptance", "0.6,1.5"],
                ["--policy", "fixed_9"], ["--policy", "threshold"], ["--policy", "draft_aware:foo=1"],
                ["--phase-dip", "40,15,0.8"],
                ["--phase-dip", "15,40"])  # fmt: skip
    for bad in bad_args:
        with pytest.raises(SystemExit):  # refused before any replay runs
            main([*args[:2], *bad])
        assert bad[0] in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["draft_aware", "hardware_aware"])
def test_a_first_probe_soon_ends_a_lock_on_a_stretch_every_answer_passes(policy):
    """The H100 run of 2026-12-06-b (T = 0, R = 256): the estimate fell while every answer of a
    batch started together was at its tokens ~15-40, and the probe after 128 plain rounds met the
    next wave of requests in that same stretch (answers of up to 128 tokens). Replayed with such a
    stretch at 0.4 of the acceptance: no probe and a first probe after 128 plain rounds leave runs
    plain and 8-12 % slower than fixed γ = 3; a first probe after 32 plain rounds (the default)
    drafts again within each run (fewer than 40 % of the plain rounds at the load) and comes within
    1.5 % of it."""
    from dspark.scheduling.lock_replay import replay

    kw = dict(
        rows=128, requests=384, runs=3, acceptance=(0.6, 0.64, 0.58), dip_rounds=0, phase_dip=(10, 40, 0.4)
    )
    runs = {e: replay(LOCK_COST, policy, probe_every=e, **kw) for e in (0, 128, PROBE_EVERY)}
    ms = {e: sum(r["ms"] for r in rs) for e, rs in runs.items()}
    fixed = sum(r["ms"] for r in replay(LOCK_COST, "fixed_3", **kw))
    assert PROBE_EVERY == 32 and ms[0] > 1.08 * fixed and ms[128] > 1.08 * fixed
    assert ms[PROBE_EVERY] < 1.015 * fixed
    stuck, probed = runs[0], runs[PROBE_EVERY]
    assert all(p["plain_at_load"] < 0.4 * s["plain_at_load"] for p, s in zip(probed, stuck))


def test_a_probe_drafts_the_length_drafted_last():
    """A probe measures the positions whose estimate made the policy stop: the length drafted
    last, the plan's best draft before any; ``rounds`` rounds of it, then the streak counts again,
    to twice as long after a probe that found nothing (the plan still plain), back to ``every``
    once the plan drafts by itself."""
    probe = PlainProbe(every=3, rounds=2)
    rates = [1.0, 0.7, 0.9, 0.8]  # the best draft by rate: 2 positions
    assert [probe(0, rates) for _ in range(9)] == [0, 0, 2, 2, 0, 0, 0, 0, 0]
    assert probe(3, rates) == 3 and not probe.fired  # the plan's own draft: the wait back to 3
    assert [probe(0, rates) for _ in range(5)] == [0, 0, 3, 3, 0] and not probe.fired
    assert [probe(0, rates[:2]) for _ in range(6)] == [0, 0, 0, 0, 1, 1]  # 3 longer than the block
    assert PlainProbe(every=0)(0, rates) == 0 and probe(0, [1.0]) == 0
    capped = PlainProbe(every=2, rounds=1, longest=4)  # waits 2, 4, 4: fruitless probes double it up to 4
    assert [capped(0, rates) for _ in range(14)] == [0, 2, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 2]
    with pytest.raises(ValueError, match="lasts"):
        PlainProbe(rounds=0)


# Whole rounds priced flat in R: a plain round 2.0 ms, one drafted position 2.4, two 2.6. With every
# position accepted half the time the table's best at 256 rows is to draft both (448 tokens / 2.6 ms).
CLOCK_COST = CostModel(
    {1: 1.0, 4096: 1.0}, round_len_ms={0: {1: 2.0, 256: 2.0}, 1: {1: 2.4, 256: 2.4}, 2: {1: 2.6, 256: 2.6}}
)
HALF = np.array([0.5, 0.5])


def test_round_clock_prices_lengths_by_what_their_rounds_took():
    """Measured / priced per rows bucket and drafted length: a timed length is priced by its own
    ratio, the others by the bucket's mean ratio (a table off by one factor keeps its order); once the
    chosen length is timed, one round in ``explore_every`` tries the best untimed length whose rate
    is within ``explore_share`` of the best."""
    clock = RoundClock(decay=0.5, min_timed=2, explore_every=3, explore_share=0.8)
    tokens = expected_tokens(HALF, 256)
    assert tokens.tolist() == [256.0, 384.0, 448.0]
    assert clock.choose(tokens, 256, CLOCK_COST) == 2  # the table's best; nothing timed, nothing explored
    clock.observe(256, 2, 3.9, CLOCK_COST)  # drafting both takes 1.5x what the table says
    assert not clock.timed(256, 2)  # min_timed rounds first
    clock.observe(200, 2, 3.9, CLOCK_COST)  # 200 rows: the same bucket (256)
    assert clock.timed(256, 2) and not clock.timed(128, 2) and not clock.timed(256, 1)
    np.testing.assert_allclose(clock.times(256, 2, CLOCK_COST), [3.0e-3, 3.6e-3, 3.9e-3])  # all x 1.5
    np.testing.assert_allclose(clock.times(128, 2, CLOCK_COST), [2.0e-3, 2.4e-3, 2.6e-3])  # another bucket
    # Rates 85, 107, 115 tokens/ms: two rounds keep the best, the third explores one drafted position
    # (107 >= 0.8 x 115); the plain round (85) is not worth a round.
    assert [clock.choose(tokens, 256, CLOCK_COST) for _ in range(3)] == [2, 2, 1]
    for _ in range(2):
        clock.observe(256, 1, 2.4, CLOCK_COST)  # one position costs what the table says
    np.testing.assert_allclose(clock.times(256, 2, CLOCK_COST), [2.5e-3, 2.4e-3, 3.9e-3])  # plain: mean 1.25
    assert clock.choose(tokens, 256, CLOCK_COST) == 1  # 160 tokens/ms against 115 and 102
    clock.observe(256, 1, 4.8, CLOCK_COST)  # the ratio decays towards what rounds take now
    assert clock.times(256, 2, CLOCK_COST)[1] == pytest.approx(2.4e-3 * (0.5 * 1.5 + 2.0) / 1.75)
    clock.reset()
    np.testing.assert_allclose(clock.times(256, 2, CLOCK_COST), [2.0e-3, 2.4e-3, 2.6e-3])
    with pytest.raises(ValueError, match="decay"):
        RoundClock(decay=1.0)


def test_round_clock_retimes_a_length_whose_timing_went_stale():
    """A few slow rounds of a length do not rule it out for the run: once ``stale_after`` rounds of
    its bucket passed without it, its timing is dropped, it is priced by the others' ratio again,
    and rounds of it start a fresh timing (not one blended with the old)."""
    clock = RoundClock(decay=0.5, min_timed=2, explore_every=100, stale_after=4)
    tokens = expected_tokens(HALF, 256)
    for _ in range(2):
        clock.observe(256, 2, 3.9, CLOCK_COST)  # two slow rounds (1.5x the table)
        clock.observe(256, 1, 2.4, CLOCK_COST)
    assert clock.choose(tokens, 256, CLOCK_COST) == 1  # 160 tokens/ms against 115
    for _ in range(4):  # rounds of 1 only: 2's timing ages
        assert clock.timed(256, 2) and clock.choose(tokens, 256, CLOCK_COST) == 1
        clock.observe(256, 1, 2.4, CLOCK_COST)
    assert not clock.timed(256, 2) and clock.timed(256, 1)  # stale: priced by 1's ratio, 448 / 2.6
    assert clock.times(256, 2, CLOCK_COST)[2] == pytest.approx(2.6e-3)
    assert clock.choose(tokens, 256, CLOCK_COST) == 2
    for _ in range(2):
        clock.observe(256, 2, 2.6, CLOCK_COST)  # what the table says, this time
    assert clock.timed(256, 2) and clock.times(256, 2, CLOCK_COST)[2] == pytest.approx(2.6e-3)
    assert clock.choose(tokens, 256, CLOCK_COST) == 2
    # Exploration tries each length once: a stale one is not explored again.
    clock = RoundClock(min_timed=1, explore_every=1, explore_share=0.0, stale_after=2)
    plans = []
    for _ in range(8):
        plans.append(clock.choose(tokens, 256, CLOCK_COST))
        clock.observe(256, plans[-1], CLOCK_COST.round_len_ms[plans[-1]][256], CLOCK_COST)
    assert plans == [2, 1, 0, 2, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="stale_after"):
        RoundClock(stale_after=0)


@pytest.mark.parametrize("policy", ["draft_aware", "hardware_aware"])
def test_draft_aware_choices_follow_the_rounds_clock(policy):
    """The engine's rounds say what the table does not: drafting two positions takes 3.9 ms, not 2.6,
    while one costs what it is priced at. Fed completed rounds in launch order (as the engines report
    them), the policy settles on one position, drafting two again only to re-time them once that timing
    goes stale (``RoundClock.stale_after``); with ``round_clock=False`` it keeps the table's two."""
    took = {0: 2.0, 1: 2.4, 2: 3.9}
    accepted = {0: [0] * 4, 1: [0, 0, 1, 1], 2: [0, 0, 1, 2]}  # each reached position accepted half the time

    def run(pol, rounds=60):
        plans = []
        for _ in range(rounds):
            m = pol.draft_length(256, 2, CLOCK_COST)
            plans.append(m)
            pol.observe_round(np.full(256, m), np.resize(accepted[m], 256))
            pol.observe_time(took[m])
        return plans

    plans = run(build_policy(policy, defaults={"check": False}), rounds=90)
    assert plans[0] == 2 and plans[-40:].count(1) >= 36, plans  # two re-timing rounds in 35
    table_only = run(build_policy(policy, defaults={"check": False, "round_clock": False}))
    assert set(table_only) == {2}


def test_policies_plan_their_draft_and_width():
    """Before drafting: a fixed length drafts only what it verifies; the threshold drafts one more
    than it verified lately and knows its width; the load-aware ones choose from the cost."""
    assert (Fixed(2).draft_length(8, 5), Fixed(2).width(5), Fixed(2).width(1)) == (2, 2, 1)
    assert (Fixed().draft_length(8, 5), Fixed().width(3)) == (5, 3)
    assert (Mtp1().draft_length(8, 5), Mtp1().width(5)) == (1, 1)
    assert (AsyncTopK().draft_length(8, 5), AsyncTopK().width(5)) == (5, None)
    cut = build_policy("draft_aware", gamma=3, block=5)
    cost = CostModel({1: 1.0, 64: 1.0}, draft_ms={1: 0.01})
    assert isinstance(cut, Truncated) and cut.draft_length(1, 5, cost) == 3 and cut.width(3) == 3
    cut.observe_round(np.array([3]), np.array([0]))
    assert cut.base.acceptance(1)[0] == pytest.approx(0.5)


def test_threshold_drafts_what_it_verifies_without_a_read_back():
    """Issue 18: the threshold drafted the whole block (7) and had the engine read its width back
    every round to verify ~1 of them. It now drafts one position beyond the longest prefix of its
    last ``window`` completed rounds, verifies at that width (known before drafting) and widens
    again when the bound cut a prefix."""
    pol = Threshold(0.5, window=2)
    assert pol.draft_length(8, 7) == 7 and pol.width(7) == 7  # nothing observed: the whole block
    pol.observe_round(np.array([1, 0, 1]), np.array([1, 0, 0]))
    assert pol.draft_length(8, 7) == 2 and pol.width(2) == 2
    # The bound truncates: confident rows verify at most the drafted 2.
    assert pol.lengths(torch.tensor([[0.9, 0.9], [0.9, 0.1], [0.3, 0.9]])).tolist() == [2, 1, 0]
    pol.observe_round(np.array([2, 1, 0]), np.array([2, 0, 0]))  # the bound was reached: widen
    assert pol.draft_length(8, 7) == 3
    for _ in range(2):
        pol.observe_round(np.array([0, 0, 0]), np.array([0, 0, 0]))
    assert pol.draft_length(8, 7) == 1  # the 2-round window forgot the longer prefixes
    pol.reset()
    assert pol.draft_length(8, 7) == 7


def test_hardware_aware_drafts_what_pays_and_reads_back_only_when_it_pays():
    """Before drafting, HardwareAware picks γ_d as the brute-force best expected rate over every
    drafted length 0..γ on the cost table (0 = a plain round at saturation, issue 18's R = 256),
    and reads the width back only when the verification it could save exceeds the read-back."""
    verify = {1: 2.0, 64: 2.4, 256: 2.65, 512: 3.3, 1024: 4.4, 2048: 7.0}
    draft = {m: {1: 0.5 + 0.06 * m, 64: 2.3, 256: 6.3 + 0.2 * m} for m in range(1, 8)}
    cost = CostModel(verify, draft_len_ms=draft, padded=True, readback_ms=0.5)
    pol = HardwareAware()
    for _ in range(10):  # acceptance ~0.76, 0.7, 0.6, ...
        pol.observe_round(np.full(100, 7), np.repeat([0, 1, 2, 3, 4, 7], [24, 23, 21, 12, 10, 10]))
    c = pol.acceptance(7)
    for R in (1, 16, 64, 256):
        a = np.cumprod(c)
        brute = [R * (1 + a[:m].sum()) / cost.round_time(R, m) for m in range(8)]
        assert pol.draft_length(R, 7, cost) == int(np.argmax(brute)), R
    assert pol.draft_length(256, 7, cost) == 0 and pol.width(0) == 0
    # R = 1: verifying 8 tokens costs 0.03 ms more than 1, less than a read-back: every row
    # verifies the whole draft, no read-back, exactly fixed γ.
    assert pol.draft_length(1, 7, cost) == 7 and pol.width(7) == 7
    assert pol.lengths(torch.full((1, 7), 0.01), cost).tolist() == [7]
    # A read-back that is free: the width is read back and the depth walk decides.
    free = CostModel(verify, draft_len_ms=draft, padded=True)
    m = pol.draft_length(64, 7, free)
    assert m > 0 and pol.width(m) is None
    assert pol.lengths(torch.full((64, m), 0.01), free).tolist() == [0] * 64
    with pytest.raises(ValueError, match="CostModel"):
        pol.draft_length(4, 5, None)


def _walking_to(width: int, drafted: int, rows: int = 64) -> np.ndarray:
    """Confidences [rows, drafted] (a shadow round's, on the host) whose walk stops at ``width``:
    every position up to it certain, none past it."""
    return np.repeat((np.arange(drafted) < width)[None], rows, 0).astype(np.float32)


def test_hardware_aware_reads_back_while_its_walks_pay():
    """The read-back pays only if walking shortens the verification: walks that keep every block
    whole (a strong drafter at R = 1, issue 18's 0.23 ms a round) turn it off; then one round in
    ``explore_every`` walks in the shadow (the round verifies its whole draft, nothing is read
    back: fixed γ's cost, and the walk's lengths come back with the outcome), and shadow walks
    that would have cut bring the real walk back."""
    verify = {1: 2.0, 64: 2.4, 512: 3.3}
    cost = CostModel(verify, draft_ms={64: 1.5}, padded=True, readback_ms=0.2)
    pol = HardwareAware(explore_every=8)
    for _ in range(10):  # a drafter whose every position is accepted: γ_d = 7 pays at R = 64
        pol.observe_round(np.full(64, 7), np.full(64, 7))

    def rounds(n, width_of):
        """``n`` rounds as an engine runs them; a walk (real or shadow) returns width_of(γ_d)."""
        walked, shadows = [], []
        for _ in range(n):
            m = pol.draft_length(64, 7, cost)
            conf = torch.full((64, m), 0.5)
            real = pol.width(m) is None
            shadow = pol.shadow_inputs(conf, cost)
            assert not (real and shadow is not None)  # a round walks for real or in the shadow
            # the engine calibrates the confidences only for a round that walks, really or not
            assert pol.reads_confidences() == (real or shadow is not None)
            assert real or pol.lengths(conf, cost).tolist() == [m] * 64  # else: the whole draft
            walked.append(real)
            shadows.append(shadow is not None)
            verified = width_of(m) if real else m
            pol.observe_round(np.full(64, verified), np.full(64, verified))  # every one accepted
            if shadow is not None:  # confidences whose walk stops at width_of(γ_d)
                pol.observe_shadow(_walking_to(width_of(m), m))
        return walked, shadows

    walk = [int(pol._walk_lengths(torch.from_numpy(_walking_to(w, 7)), cost).max()) for w in range(8)]
    assert walk == list(range(8))  # the shadow confidences below walk where they should
    # Largest saving 0.9 ms > 0.2: the first rounds walk; each keeps the whole block (saves 0).
    first, _ = rounds(3, lambda m: m)
    assert first[0] and pol._realised < 0.2 / 0.9
    later, shadows = rounds(24, lambda m: m)
    assert not any(later) and sum(shadows) == 3 and not any(shadows[:4])  # one round in 8, no read-back
    # Shadow walks that would have cut every block to nothing: the read-back pays again (one
    # round in 8 verifies its whole draft, to time it against the walks).
    cut, _ = rounds(24, lambda m: 0)
    assert not any(cut[:4]) and sum(cut[-8:]) == 7
    # A policy without shadows (the default) never computes one; those that need no confidences
    # read none, the others read them every round.
    assert Fixed().shadow_inputs(torch.full((2, 3), 0.5)) is None
    assert not any(p.reads_confidences() for p in (Fixed(), Mtp1(), DraftAware()))
    assert Threshold().reads_confidences() and Truncated(Threshold(), 3).reads_confidences()
    with pytest.raises(ValueError, match="explore_every"):
        HardwareAware(explore_every=0)


def test_hardware_aware_prices_a_draft_length_by_its_whole_rounds_only():
    """A walk verifies less than the draft, so its round is cheaper than the whole draft's and
    emits fewer tokens. The planner counts the whole draft's tokens, so only rounds that verified
    the whole draft may time γ_d (the H200, T = 0, R = 256: walked rounds of 7 read as cheap made
    the plan draft 7 where 4 paid). Rounds of 200 live rows and of 256 share the 256 bucket."""
    cost = CostModel({1: 2.0, 64: 2.4, 256: 2.6, 512: 3.3, 2048: 6.0}, draft_ms={256: 1.5}, padded=True,
                     readback_ms=0.2)  # fmt: skip
    pol = HardwareAware(explore_every=4, min_timed=2)
    for _ in range(10):
        pol.observe_round(np.full(256, 7), np.full(256, 7))
    walked = []
    for i in range(12):
        rows = 256 if i % 2 else 200
        m = pol.draft_length(rows, 7, cost)
        walked.append(pol.width(m) is None)
        verified = 2 if walked[-1] else m
        pol.observe_round(np.full(rows, verified), np.full(rows, verified))
        pol.observe_time(0.5 if walked[-1] else 5.0)
    assert any(walked) and not all(walked)
    timed = pol._rounds._stats[256][2]  # rounds timed per drafted length
    assert timed[7] == walked.count(False)  # the whole rounds only, both row counts in one bucket
    clocked = pol._clocked_walk(256, 7, cost)
    assert clocked is not None and pol._clocked_walk(129, 7, cost) == clocked


def test_hardware_aware_walks_only_where_the_clock_says_walking_is_faster():
    """The cost table says the walk pays at R = 64 (0.9 ms to save, 0.2 ms to read back) but the
    rounds say otherwise (issue 18's H200 run: walked rounds slower than whole ones). Once the
    clock has ``min_timed`` rounds of each, HardwareAware walks only where walked rounds emitted
    more tokens per ms; one round in ``explore_every`` still runs the other way (a whole-draft
    round among walks, a real walk where the clock ruled walks out) so both clocks stay current.
    Rows counts are timed apart: R = 16's clock says nothing about R = 64. (The table alone plans
    the draft, always 7: the rounds' clock would explore other lengths, each timed apart.)"""
    cost = CostModel({1: 2.0, 16: 2.1, 64: 2.4, 128: 2.6, 512: 3.3}, draft_ms={64: 1.5}, padded=True,
                     readback_ms=0.2)  # fmt: skip
    pol = HardwareAware(explore_every=4, min_timed=2, round_clock=False)
    for _ in range(10):
        pol.observe_round(np.full(64, 7), np.full(64, 7))

    def rounds(n, ms_walked, ms_whole, rows=64):
        """Walks cut every block to 2 (3 tokens a row, the table's estimate keeps walking); whole
        rounds verify and accept all 7 (8 tokens a row)."""
        walked = []
        for _ in range(n):
            m = pol.draft_length(rows, 7, cost)
            walked.append(pol.width(m) is None)
            verified = 2 if walked[-1] else m
            pol.observe_round(np.full(rows, verified), np.full(rows, verified))
            pol.observe_time(ms_walked if walked[-1] else ms_whole)
        return walked

    # The table says walk. Two walked rounds (74 tokens/ms) and no whole one yet: the clock weighs
    # them against what a whole round is expected to emit (8 tokens a row in the table's 4.8 ms:
    # 107 tokens/ms) and walks no more, but for one real walk in 4 (not a shadow) that re-times them.
    assert rounds(2, 2.6, 2.7) == [True, True]
    assert (64, 7, False) not in pol._clock and pol._clocked_walk(64, 7, cost) is False
    assert rounds(6, 2.6, 2.7) == [False, True, False, False, False, True]
    # Timed whole rounds (190 tokens/ms) say the same.
    later = rounds(8, 2.6, 2.7)
    assert later == [False, False, False, True] * 2
    assert pol.shadow_inputs(torch.full((64, 7), 0.5), cost) is None
    # Walks become the faster way (0.5 ms: 384 tokens/ms): the clock brings them back once the
    # exploring walks outweigh the old ones.
    assert rounds(48, 0.5, 2.7)[-4:] == [True, True, True, False]
    assert pol._clocked_walk(16, 7, cost) is None  # another row count: the table decides there
    pol.observe_time(1.0)  # a time without a planned round is ignored
    pol.forget()
    assert pol._clocked_walk(64, 7, cost) is None
    with pytest.raises(ValueError, match="min_timed"):
        HardwareAware(min_timed=0)


def test_hardware_aware_stops_slow_walks_before_it_has_timed_whole_rounds_of_their_length():
    """Issue 18's H100 run (T = 1, R = 256, 2026-12-06): walked γ_d = 3 rounds emitted 93 tokens/ms
    against whole ones' 116, but whole rounds among walks come one in ``explore_every`` (32), so
    the clock waited on four of them and 102 rounds walked (the first run at 0.56 x target-only's
    throughput). Here walks cut every block to 1 but cost 1.3 x a whole round: with the default
    clock they stop after ``min_timed`` walked rounds, weighed against what a whole round of the
    same length is expected to emit, not after the 31 they ran when whole rounds had to be timed."""
    cost = CostModel({1: 1.0, 256: 1.6, 512: 2.0, 1024: 2.6, 2048: 4.0}, draft_ms={256: 1.2}, padded=True,
                     readback_ms=0.08)  # fmt: skip
    pol = HardwareAware()
    walks = []  # the drafted length of each walked round
    for _ in range(32):
        m = pol.draft_length(256, 7, cost)
        walked = pol.width(m) is None
        walks += [m] if walked else []
        lengths = np.full(256, 1 if walked else m)
        pol.observe_round(lengths, np.minimum(np.arange(256) % 3, lengths))
        pol.observe_time(cost.round_seconds(256, m)[m] * 1e3 * (1.3 if walked else 1.0))
    assert walks.count(7) == pol.min_timed  # (a length the rounds' clock explores later walks anew)
    assert pol._clock.get((256, 7, False), [0, 0, 0])[2] < pol.min_timed  # whole rounds of 7: untimed


def test_hardware_aware_weighs_a_walk_against_the_same_draft_verified_whole():
    """Issue 18's H100 run (T = 0, R = 64): walked rounds, mostly 5 and 7 drafted, emitted more
    tokens per ms than whole rounds, mostly 3 and 4 drafted, so walks stayed on in a run that lost
    6.7 % to fixed γ = 3. Here walked γ_d = 7 rounds (192 tokens/ms) beat whole γ_d = 3 ones (128)
    but not whole γ_d = 7 ones (205): once the clock has timed both ways at 7, walks stop there
    but for one re-timing walk in ``explore_every``; at 3 (too little to save) nothing walks."""
    cost = CostModel({1: 2.0, 64: 2.4, 256: 2.5, 512: 3.3}, draft_ms={64: 1.5}, padded=True, readback_ms=0.2)
    pol = HardwareAware(explore_every=4, min_timed=2, round_clock=False)
    for _ in range(10):
        pol.observe_round(np.full(64, 7), np.full(64, 7))

    def rounds(n, gamma):
        walked = []
        for _ in range(n):
            m = pol.draft_length(64, gamma, cost)
            assert m == gamma
            walked.append(pol.width(m) is None)
            verified = 2 if walked[-1] else m
            pol.observe_round(np.full(64, verified), np.full(64, verified))
            pol.observe_time(1.0 if walked[-1] else {3: 2.0, 7: 2.5}[m])
        return walked

    assert not any(rounds(4, 3))  # 0.1 ms to save at most: below the read-back
    walked = rounds(16, 7)
    assert walked[:4] == [True, True, True, False]  # the table says walk; one whole round in 4
    assert pol._clocked_walk(64, 7, cost) is False and pol._clocked_walk(64, 3, cost) is None
    assert walked[-8:] == [False, False, False, True] * 2  # a real walk in 4 re-times walks
    lengths = {(c["drafted"], c["walked"]) for c in pol.walk_state()["clock"]}
    assert lengths == {(3, False), (7, False), (7, True)}


def test_hardware_aware_explores_in_the_shadow_where_walks_neither_pay_nor_save():
    """Issue 18's H100 run (T = 1, R = 64): walks kept every block whole (the estimate: they save
    nothing) and the clock timed walked rounds at 0.4 of whole ones' tokens per ms, yet one round
    in ``explore_every`` still walked for real, paying the read-back only to confirm it. A real
    walk explores only while the estimate says walks pay and the clock alone rules them out;
    once both agree, the exploring round walks in the shadow (nothing read back)."""
    cost = CostModel({1: 2.0, 64: 2.4, 128: 2.6, 512: 3.3}, draft_ms={64: 1.5}, padded=True, readback_ms=0.2)
    pol = HardwareAware(explore_every=4, min_timed=2, round_clock=False)  # the draft: always 7
    for _ in range(10):
        pol.observe_round(np.full(64, 7), np.full(64, 7))

    def rounds(n, width):
        """Walks (real or shadow) stop at ``width``; a walked round emits 0.4 of a whole one's
        tokens per ms."""
        real, shadows = [], []
        for _ in range(n):
            m = pol.draft_length(64, 7, cost)
            real.append(pol.width(m) is None)
            shadow = pol.shadow_inputs(torch.full((64, m), 0.5), cost)
            shadows.append(shadow is not None)
            verified = min(width, m) if real[-1] else m
            pol.observe_round(np.full(64, verified), np.full(64, verified))
            if shadow is not None:
                pol.observe_shadow(_walking_to(min(width, m), m))
            pol.observe_time(2.7 * (verified + 1) / (m + 1) / 0.4 if real[-1] else 2.7)
        return real, shadows

    real, _ = rounds(12, width=2)  # walks cut (they would pay) but the clock times them slower
    assert pol._clocked_walk(64, 7, cost) is False and real[-4:] == [False, False, False, True]  # re-timed
    real, shadows = rounds(24, width=7)  # now walks keep every block whole: they save nothing
    assert pol._realised < 0.2 / 0.9
    assert not any(real[8:]) and sum(shadows[8:]) == 4  # one round in 4 explores, in the shadow


def test_draft_aware_choice_is_lossless_and_anticipation_is_not():
    """Exact enumeration (2 requests, γ = 2, token-dependent c2): a draft length fixed before the
    draft — any value, e.g. the one DraftAware plans from earlier rounds — reproduces the target
    law; choosing after looking at the draft (verify x1 only when c2, a function of x1, looks
    good) does not."""
    rng = np.random.default_rng(11)
    caught = 0
    for _ in range(40):
        inst = random_instance(rng, R=2)
        for m in (0, 1, 2):
            laws = exact_output_law(lambda c, m=m: DraftAware().lengths(c[:, :m], None), inst)
            for r in range(2):
                np.testing.assert_allclose(laws[r], target_law(inst, r), atol=1e-12)

        def peeking(c):  # whether x1 is verified depends on x1
            return torch.where(c[:, 1] > 0.5, 2, 0)

        laws = exact_output_law(peeking, inst)
        caught += any(not np.allclose(laws[r], target_law(inst, r), atol=1e-9) for r in range(2))
    assert caught > 0


# ---------------------------------------------------------------------------------------------
# cost model
# ---------------------------------------------------------------------------------------------


def test_cost_draft_lengths_overhead_and_round_time(tmp_path):
    cm = CostModel(
        {1: 4.0, 8: 4.0, 64: 8.0},
        draft_ms={1: 2.0, 16: 4.0},
        draft_len_ms={2: {1: 1.0, 16: 2.0}, 4: {1: 1.5, 16: 3.0}},
        overhead_ms=0.5,
    )
    assert cm.round_time(1, 0) == pytest.approx(0.004)  # plain decoding: the verify step alone
    assert cm.round_time(1, 2) == pytest.approx((4.0 + 1.0 + 0.5) * 1e-3)  # B = 3
    assert cm.round_time(16, 4) == pytest.approx(
        (8.0 + 16 * 4 / 56 + 3.0 + 0.5) * 1e-3
    )  # B = 80: extrapolated
    assert cm.round_time(1, 3) == pytest.approx((4.0 + 1.25 + 0.5) * 1e-3)  # between profiled lengths
    assert cm.round_time(1, 1) == pytest.approx((4.0 + 1.0 + 0.5) * 1e-3)  # below: the shortest
    assert cm.round_time(1, 6) == pytest.approx((4.0 + 1.5 + 0.5) * 1e-3)  # beyond: the longest
    assert cm.round_time(2, 2, B=8) == pytest.approx((4.0 + 1.0 + 1 / 15 + 0.5) * 1e-3)
    assert cm.step_time(8, 1) == pytest.approx((4.0 + 2.0 + 0.5) * 1e-3)  # Alg. 1: whole block drafted
    back = CostModel.from_json(cm.to_json())
    assert back == cm and back.draft_len_ms == {2: {1: 1.0, 16: 2.0}, 4: {1: 1.5, 16: 3.0}}
    assert back.overhead_ms == 0.5 and not back.padded
    assert CostModel.from_json(CostModel({1: 1.0}, padded=True).to_json()).padded
    old = cm.to_dict()
    del old["draft_len_ms"], old["overhead_ms"], old["padded"]  # a table written before they existed
    assert CostModel.from_dict(old).round_time(1, 2) == pytest.approx((4.0 + 2.0) * 1e-3)
    with pytest.raises(CostTableError, match=r"draft_len_ms\[2\]"):
        CostModel({1: 1.0}, draft_len_ms={2: {1: 5.0, 8: 1.0}})
    with pytest.raises(CostTableError, match="overhead_ms"):
        CostModel({1: 1.0}, overhead_ms=-1.0)
    # A round's fixed part is the draft of the positions it drafted (the whole block by default).
    assert cm.fixed_ms(1, 2) == pytest.approx(1.0 + 0.5) and cm.fixed_ms(1) == pytest.approx(2.0 + 0.5)
    only_lengths = CostModel({1: 4.0}, draft_len_ms={2: {1: 1.0}, 4: {1: 1.5}})
    assert only_lengths.fixed_ms(1) == pytest.approx(1.5) and only_lengths.step_time(1, 1) == pytest.approx(
        5.5e-3
    )
    # The curve the pre-draft choice reads every round, and the read-back's price, kept in the file.
    np.testing.assert_allclose(cm.round_times(16, 4), [cm.round_time(16, m) for m in range(5)])
    assert cm.round_times(16, 4) is cm.round_times(16, 4)
    back = CostModel.from_json(CostModel({1: 1.0}, readback_ms=0.7).to_json())
    assert back.readback_ms == 0.7 and CostModel.from_dict(old).readback_ms == 0.0
    with pytest.raises(CostTableError, match="readback_ms"):
        CostModel({1: 1.0}, readback_ms=float("nan"))
    # Measured whole rounds, {γ_d: {R: ms}} with 0 a plain round: read for a whole-draft round of
    # a measured length (interpolated in R), the steps' sum otherwise (another length, or a B given).
    rounds = CostModel({1: 4.0, 8: 4.0, 64: 8.0}, draft_len_ms={2: {1: 1.0, 16: 2.0}},
                       round_len_ms={0: {1: 3.0, 16: 3.5}, 2: {1: 4.5, 16: 6.0}})  # fmt: skip
    assert rounds.round_time(1, 2) == pytest.approx(4.5e-3) and rounds.round_time(16, 0) == pytest.approx(
        3.5e-3
    )
    assert rounds.round_time(6, 2) == pytest.approx((4.5 + 1.5 * 5 / 15) * 1e-3)
    assert rounds.round_time(1, 1) == pytest.approx((4.0 + 1.0) * 1e-3)  # not measured: the steps
    assert rounds.round_time(1, 2, B=8) == pytest.approx((4.0 + 1.0) * 1e-3)
    back = CostModel.from_json(rounds.to_json())
    assert back == rounds and back.round_len_ms == {0: {1: 3.0, 16: 3.5}, 2: {1: 4.5, 16: 6.0}}
    assert cm.round_len_ms is None and CostModel.from_dict(old).round_len_ms is None
    bad_tables = (
        ({-1: {1: 1.0}}, "round_len_ms: key must be non-negative"),
        ({"x": {1: 1.0}}, "not an integer"),
        ({2: {1: 5.0, 8: 1.0}}, r"round_len_ms\[2\]"),  # faster with more rows
    )
    for bad, match in bad_tables:
        with pytest.raises(CostTableError, match=match):
            CostModel({1: 1.0}, round_len_ms=bad)
    # The device table prices B exactly as the host lookup does.
    table = cm.verify_table(100, "cpu")
    assert table.dtype == torch.float64 and table.numel() > 100
    plain = CostModel({1: 4.0, 8: 4.0, 64: 8.0})
    np.testing.assert_allclose(table[1:101].numpy(), 1e3 * plain.step_time(np.arange(1, 101)), rtol=1e-14)


def test_cost_rejects_bad_tables():
    with pytest.raises(CostTableError, match="empty"):
        CostModel({})
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(CostTableError, match=r"> 0 ms.*\(2, "):
            CostModel({1: 1.0, 2: bad})
    with pytest.raises(CostTableError, match="positive"):
        CostModel({0: 1.0, 2: 1.0})
    with pytest.raises(CostTableError, match="integer"):
        CostModel({1.5: 1.0})
    with pytest.raises(CostTableError, match="empty"):
        CostModel({1: 1.0}, draft_ms={})


def test_cost_monotonicity_tolerance():
    with pytest.raises(CostTableError, match=r"B=2: 10 ms -> B=4: 8 ms"):
        CostModel({1: 9.0, 2: 10.0, 4: 8.0, 8: 20.0})
    CostModel({1: 10.0, 2: 9.6, 4: 12.0})  # a 4% dip is jitter
    # A staircase of small dips adds up against the running maximum.
    with pytest.raises(CostTableError, match="B=1: 10 ms -> B=3: 9.216 ms"):
        CostModel({1: 10.0, 2: 9.6, 3: 9.216})
    CostModel({1: 10.0, 2: 8.0}, monotone_tol=0.25)  # the tolerance is a parameter
    with pytest.raises(CostTableError, match="draft_ms"):
        CostModel({1: 1.0}, draft_ms={1: 5.0, 8: 1.0})


def test_cost_interpolation_and_extrapolation():
    cm = CostModel({4: 10.0, 8: 18.0, 16: 18.0 + 0.5})
    assert cm.step_time(4) == pytest.approx(0.010)
    assert cm.step_time(6) == pytest.approx(0.014)  # linear between points
    assert cm.step_time(1) == pytest.approx(0.010)  # below the table: the smallest point
    assert cm.step_time(24) == pytest.approx(0.0190)  # beyond: the last two points' slope
    assert cm.sps(6) == pytest.approx(1 / 0.014)
    np.testing.assert_allclose(cm.step_time(np.array([4, 6, 24])), [0.010, 0.014, 0.019])
    # A within-tolerance dip at the end never extrapolates downwards.
    assert CostModel({1: 10.0, 2: 9.8}).step_time(100) == pytest.approx(0.0098)
    assert CostModel({3: 7.0}).step_time(100) == pytest.approx(0.007)  # one point: constant

    cd = CostModel({4: 10.0, 8: 18.0}, draft_ms={1: 2.0, 5: 6.0})
    assert cd.step_time(6, 3) == pytest.approx(0.014 + 0.004)  # T_draft(R) + T_verify(B)
    assert cd.sps(6, 3) == pytest.approx(1 / 0.018)
    with pytest.raises(ValueError, match="pass R"):
        cd.step_time(6)
    with pytest.raises(ValueError, match="positive"):
        cm.step_time(0)


def test_cost_names_a_draft_vocabulary_its_draft_steps_were_not_timed_with():
    """Draft steps timed over one draft vocabulary misprice runs over another (meta's draft_vocab,
    None: the whole); a table without draft steps prices none, whatever the vocabulary."""
    k16 = {"size": 16384, "coverage": 0.99}
    drafts = CostModel({4: 10.0, 8: 18.0}, draft_ms={1: 2.0}, meta={"draft_vocab": k16})
    assert drafts.draft_vocab_mismatch(k16) is None
    assert "timed with draft vocabulary {'size': 16384" in drafts.draft_vocab_mismatch(None)
    by_length = CostModel({4: 10.0, 8: 18.0}, draft_len_ms={7: {1: 2.0}})  # engine_sps's curves, whole
    assert by_length.draft_vocab_mismatch(None) is None and by_length.draft_vocab_mismatch(k16)
    assert CostModel({4: 10.0, 8: 18.0}).draft_vocab_mismatch(k16) is None  # verify steps only


def test_cost_analytical_shapes():
    cm = CostModel.analytical(base_ms=8.0, knee=16, ms_per_token=0.5, max_batch=256)
    assert cm.step_time(1) == cm.step_time(16) == pytest.approx(0.008)
    assert cm.step_time(116) == pytest.approx(0.008 + 0.05)
    assert cm.step_time(1000) == pytest.approx(0.008 + 0.5e-3 * 984)
    jag = CostModel.analytical(base_ms=8.0, knee=16, ms_per_token=0.5, max_batch=64, tile=8)
    assert jag.step_time(17) == jag.step_time(24) == pytest.approx(0.008 + 0.004)
    assert jag.step_time(25) == pytest.approx(0.008 + 0.008)
    assert CostModel.analytical(draft_ms=3.0).step_time(1, 7) == pytest.approx(0.013)


def test_cost_json_round_trip(tmp_path):
    cm = CostModel(
        {1: 10.0, 64: 10.5, 512: 40.0},
        draft_ms={1: 1.0, 32: 3.0},
        context_len=2048,
        meta={"device": "cpu", "dtype": "bf16"},
        monotone_tol=0.1,
    )
    back = CostModel.from_json(cm.to_json())
    assert back == cm and back.verify_ms == {1: 10.0, 64: 10.5, 512: 40.0}
    assert back.draft_ms == {1: 1.0, 32: 3.0} and back.context_len == 2048 and back.monotone_tol == 0.1
    path = cm.save(tmp_path / "sub" / "sps.json")
    assert CostModel.load(path) == cm
    assert sorted(p.name for p in path.parent.iterdir()) == ["sps.json"]  # no temp left behind
    cm2 = CostModel.analytical()
    cm2.save(path)  # atomic replace of an existing file
    assert CostModel.load(path) == cm2
    d = json.loads(cm.to_json())
    d["format"] = "something/v9"
    with pytest.raises(CostTableError, match="format"):
        CostModel.from_dict(d)
    d = json.loads(cm.to_json())
    d["verify_ms"]["128"] = -1
    with pytest.raises(CostTableError, match="> 0"):
        CostModel.from_json(json.dumps(d))


def test_profile_median_warmup_and_sync():
    clock = [0.0]
    calls: list[int] = []
    syncs = [0]
    jitter = iter([0.0, 5.0, 0.0, 0.0, 0.0] * 10)  # one slow outlier per B

    def step(b):
        calls.append(b)
        if len(calls) % 7 > 1:  # past the 2 warm-up calls of each B (2 + 5 = 7 per B)
            clock[0] += (b + next(jitter)) * 1e-3

    def timer():
        return clock[0]

    def sync():
        syncs[0] += 1

    out = profile(step, [1, 8, 32], warmup=2, repeats=5, timer=timer, sync=sync)
    assert out == pytest.approx({1: 1.0, 8: 8.0, 32: 32.0})  # median ignores the outlier
    assert calls == [1] * 7 + [8] * 7 + [32] * 7
    assert syncs[0] == 3 * (1 + 2 * 5)
    assert CostModel(out).step_time(8) == pytest.approx(0.008)
    with pytest.raises(ValueError):
        profile(step, [0])
    real = profile(lambda b: sum(range(b)), [10, 1000], warmup=0, repeats=1, sync=None)
    assert set(real) == {10, 1000} and all(v > 0 for v in real.values())


# ---------------------------------------------------------------------------------------------
# the verify step per width (a padded step priced at its own row count)
# ---------------------------------------------------------------------------------------------


def test_verify_rows_ms_prices_r_rows_at_a_width():
    """``verify_width_ms`` {w: {R: ms}}: exact at the measured points, interpolated over R per
    width, linear in the width between measured widths, the last two widths' slope beyond; without
    it, the token curve at R·w (the old price); kept through JSON; bad tables refused."""
    tokens = {1: 1.0, 8: 1.2, 64: 2.0, 512: 4.0}
    widths = {1: {1: 1.0, 64: 2.0}, 8: {1: 1.2, 64: 2.6}}
    cost = CostModel(tokens, padded=True, verify_width_ms=widths)
    assert cost.verify_rows_ms(64, 8) == pytest.approx(2.6)
    assert cost.verify_rows_ms(64, 1) == pytest.approx(2.0)
    assert cost.verify_rows_ms(32, 1) == pytest.approx(1.0 + 1.0 * 31 / 63)
    assert cost.verify_rows_ms(64, 4) == pytest.approx(2.0 + 0.6 * 3 / 7)
    assert cost.verify_rows_ms(64, 15) == pytest.approx(2.6 + 0.6)  # slope 0.6 per 7 widths
    np.testing.assert_allclose(cost.verify_rows_ms(64, np.array([1, 8])), [2.0, 2.6])
    # a width asked again is read from what the first call kept: the same price, a float
    assert cost.verify_rows_ms(64, 4) == pytest.approx(cost.verify_rows_ms(64, np.array([4]))[0])
    assert isinstance(cost.verify_rows_ms(64, 4), float)
    # 64 rows 8 wide is what the engine runs; the token curve at 512 tokens was 4.0 ms, and 64 rows
    # 4 wide read at 256 tokens would have been priced as 32 rows 8 wide
    old = CostModel(tokens, padded=True)
    assert old.verify_rows_ms(64, 4) == pytest.approx(old.verify_time_ms(256))
    assert CostModel.from_json(cost.to_json()).verify_width_ms == {1: {1: 1.0, 64: 2.0}, 8: {1: 1.2, 64: 2.6}}
    assert CostModel.from_json(cost.to_json()) == cost
    assert "verify widths=[1, 8]" in repr(cost)
    for bad in ({}, {"x": {1: 1.0}}, {1: {}}, {1: {1: -1.0}}):
        with pytest.raises(CostTableError, match="verify_width_ms"):
            CostModel(tokens, verify_width_ms=bad)


def test_engine_rows_price_a_round_at_its_bucket():
    """An engine that pads a round of R live rows to a rows bucket runs the bucket's step: priced
    there (the round, its draft step, each verify width and so the choice of γ_d), R itself past the
    largest bucket; the table as saved is unchanged."""
    tokens = {1: 1.0, 64: 2.0, 256: 4.0, 2048: 9.0}
    widths = {1: {1: 1.0, 64: 1.5, 256: 2.0}, 8: {1: 1.2, 64: 2.6, 256: 6.0}}
    rounds = {0: {1: 1.0, 64: 1.5, 256: 2.0}, 7: {1: 1.5, 64: 3.0, 256: 8.0}}
    cost = CostModel(tokens, draft_len_ms={7: {1: 0.3, 256: 1.3}}, padded=True, verify_width_ms=widths,
                     round_len_ms=rounds)  # fmt: skip
    engine = cost.at_engine_rows([256, 1, 64])
    for live, runs in [(1, 1), (2, 64), (64, 64), (65, 256), (150, 256), (256, 256), (300, 300)]:
        assert engine.round_times(live, 7).tolist() == cost.round_times(runs, 7).tolist()
        assert engine.verify_rows_ms(live, 8) == cost.verify_rows_ms(runs, 8)
        assert engine.fixed_ms(live, 7) == cost.fixed_ms(runs, 7)
    assert cost.round_time(150, 7) < engine.round_time(150, 7) == pytest.approx(8e-3)
    # 150 live rows of the 256-row graph: drafting looked worth it read at 150 rows, not at 256
    acceptance = np.full(7, 0.6)
    assert np.argmax(expected_rates(acceptance, 150, cost)) > 0
    assert np.argmax(expected_rates(acceptance, 150, engine)) == 0
    assert engine.to_dict() == cost.to_dict() and engine == cost
    with pytest.raises(ValueError, match="positive"):
        cost.at_engine_rows([0, 8])


def test_padded_round_time_and_walk_use_the_width_table():
    """A whole-draft round without a measured round is priced at R rows γ_d + 1 wide; the padded
    walk prices each depth the same way. Where the width table says narrower steps of these rows
    save nothing (the attention and per-row work stay), the walk keeps the whole depth that the
    token curve (each depth read as fewer, wider rows) would have cut short."""
    R, G = 16, 4
    tokens = {16: 1.0, 32: 1.6, 48: 2.2, 64: 2.8, 80: 3.4}  # steep: fewer rows are much cheaper
    flat = {w: {16: 2.0 + 0.05 * (w - 1)} for w in range(1, G + 2)}  # R rows, any width: ~2 ms
    draft = {G: {16: 0.5}}
    cost = CostModel(tokens, draft_len_ms=draft, padded=True, verify_width_ms=flat)
    assert cost.round_time(R, G) == pytest.approx((2.0 + 0.05 * G + 0.5) * 1e-3)
    assert cost.round_time(R, G, B=R * (G + 1)) == pytest.approx((3.4 + 0.5) * 1e-3)  # B given: tokens
    conf = torch.tensor([[0.9, 0.6, 0.5, 0.4]] * R)
    ha = HardwareAware()
    assert ha(conf, cost).tolist() == [G] * R
    steep = CostModel(tokens, draft_len_ms=draft, padded=True)
    assert ha(conf, steep).tolist() == depth_walk_reference(conf, steep)
    assert ha(conf, steep).tolist()[0] < G
    # The walk's price of every depth is the width table's, to the digit.
    a = prefix_survival(conf.double())
    expected = [(R + a[:, :w].sum().item()) / (flat[1 + w][16] + 0.5) for w in range(G + 1)]
    from dspark.scheduling.policies import depth_path

    np.testing.assert_allclose(depth_path(conf.double(), cost).tolist(), expected, rtol=1e-12)
    # throughput_path over whole depths, with the drafted length known, reads the same prices
    rows, j, a_sorted = admission_order(conf.double())
    theta = throughput_path(a_sorted, R, cost, j, G)
    width = np.maximum.accumulate(np.concatenate([[0], j.numpy()]))
    tau = R + np.concatenate([[0.0], np.cumsum(a_sorted.numpy())])
    priced = np.array([flat[1 + w][16] for w in width]) + 0.5
    np.testing.assert_allclose(theta.numpy(), tau / (priced * 1e-3))
    # Still Algorithm 1's early stop on whole depths: the exact output law is the target's.
    rng = np.random.default_rng(5)
    for _ in range(10):
        inst = random_instance(rng, R=2)
        laws = exact_output_law(lambda c: ha(c, cost), inst)
        for r in range(2):
            np.testing.assert_allclose(laws[r], target_law(inst, r), atol=1e-12)


def test_engine_sps_width_curves_lift_dips_per_width():
    from dspark.bench.sps import width_curves

    results = [  # graph replays where captured, the static eager step otherwise (as on the CPU)
        {"rows": 1, "width": 1, "static_eager_ms": 9.0, "graph_ms": 1.0},
        {"rows": 4, "width": 1, "static_eager_ms": 9.0, "graph_ms": 0.9},
        {"rows": 16, "width": 1, "static_eager_ms": 9.0, "graph_ms": 1.5},
        {"rows": 1, "width": 8, "static_eager_ms": 9.0, "graph_ms": 1.2},
        {"rows": 4, "width": 8, "static_eager_ms": 1.4},
    ]
    assert width_curves(results, [1, 8, 16]) == {1: {1: 1.0, 4: 1.0, 16: 1.5}, 8: {1: 1.2, 4: 1.4}}
