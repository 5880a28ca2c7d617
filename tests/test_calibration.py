"""STS calibration and per-position metrics (DSpark §3.2.1, Fig. 6)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torchmetrics.functional.classification import binary_auroc, binary_calibration_error

from dspark.artifacts import DrafterFolder, load_calibration
from dspark.calibration.metrics import (
    _ece_l1,
    ece_noise_floor,
    expected_calibration_error,
    position_metrics,
    reliability_bins,
    reliability_data,
    summary,
)
from dspark.calibration.plots import reliability_diagram
from dspark.calibration.sts import Calibration, cumulative_confidence, fit_sts, fit_sts_offsets
from dspark.core.errors import ConfigError, DataError

GAMMA = 7
OVERCONFIDENCE = 3.0  # observed logit = 3 * true logit, so the ideal temperature is 3 everywhere


def _true_logits(n: int, g: torch.Generator, shared_only: bool = False) -> torch.Tensor:
    """Per-sample, per-position true survival log-odds: a shared per-sample difficulty plus
    position-specific noise (unless ``shared_only``), with survival decaying along the block."""
    u = torch.randn(n, 1, generator=g)
    q = torch.linspace(1.5, 0.3, GAMMA) + 0.8 * u
    if not shared_only:
        q = q + 0.7 * torch.randn(n, GAMMA, generator=g)
    return q


def rollouts(n: int, seed: int, shared_only: bool = False):
    """Kind (a): engine rounds. y_k = y_{k-1} ∧ Bernoulli(p_k); valid for k ≤ proposed length ℓ."""
    g = torch.Generator().manual_seed(seed)
    q = _true_logits(n, g, shared_only)
    labels = (torch.rand(n, GAMMA, generator=g) < torch.sigmoid(q)).long().cumprod(1).float()
    # Half the rounds propose the full block, the rest a uniform length: later positions stay populated.
    ell = torch.randint(1, GAMMA + 1, (n, 1), generator=g)
    ell = torch.where(torch.rand(n, 1, generator=g) < 0.5, torch.full_like(ell, GAMMA), ell)
    valid = torch.arange(1, GAMMA + 1) <= ell
    labels = torch.where(valid, labels, torch.full_like(labels, -1.0))  # padding must be ignored
    return OVERCONFIDENCE * q, labels, valid


def teacher_forced(n: int, seed: int):
    """Kind (b): soft labels Π c*_i with c* a noisy version of the true per-step acceptance."""
    g = torch.Generator().manual_seed(seed)
    q = _true_logits(n, g)
    c_star = torch.sigmoid(q + 0.3 * torch.randn(n, GAMMA, generator=g))
    lengths = torch.randint(1, GAMMA + 1, (n, 1), generator=g)
    valid = torch.arange(1, GAMMA + 1) <= lengths  # eval mask (e.g. sequence end inside the block)
    return OVERCONFIDENCE * q, c_star.cumprod(1), valid


@pytest.fixture(scope="module")
def fitted():
    z, y, v = rollouts(20_000, seed=1)
    temps = fit_sts(z, y, v)
    zh, yh, vh = rollouts(20_000, seed=2)  # held-out draw for evaluation
    return temps, (z, y, v), (zh, yh, vh), position_metrics(zh, yh, vh, temps)


def test_sts_fixes_overconfidence_on_held_out(fitted):
    temps, _, _, rows = fitted
    s = summary(rows)
    print(f"\nT = {[round(t, 3) for t in temps.tolist()]}")
    for r in rows:
        print(
            f"k={r['position']} n={r['count']} ece {r['ece_raw']:.4f} -> {r['ece_sts']:.4f}  "
            f"auroc {r['auroc']:.4f} -> {r['auroc_sts']:.4f}"
        )
    print(s)
    assert s["ece_raw_mean"] > 0.05
    assert s["ece_sts_mean"] < 0.015
    assert all(r["ece_sts"] < r["ece_raw"] for r in rows)
    assert all(r["brier_sts"] < r["brier_raw"] for r in rows)
    # The fit recovers the planted overconfidence factor.
    assert torch.allclose(temps, torch.full_like(temps, OVERCONFIDENCE), rtol=0.3)


def test_sts_preserves_rankings(fitted):
    temps, _, (z, y, v), rows = fitted
    # k = 1: the cumulative prediction is c_1 itself, a monotone map of z_1.
    assert rows[0]["auroc_sts"] == pytest.approx(rows[0]["auroc"], abs=1e-6)
    # Every k: each c_k's ranking is untouched, so the conditional AUROC of c_k against "token k
    # survived", among rounds that reached k, is unchanged.
    cal = torch.sigmoid(z / temps.float())
    for k in range(1, GAMMA):
        m = v[:, k] & (y[:, k - 1] == 1)
        target = y[:, k][m].long()
        a_raw = binary_auroc(torch.sigmoid(z[:, k][m]), target)
        a_sts = binary_auroc(cal[:, k][m], target)
        assert float(a_sts) == pytest.approx(float(a_raw), abs=1e-6)


def test_cumulative_auroc_invariant_when_positions_share_a_ranking():
    # The cumulative product's cross-sample ranking is preserved under any positive temperatures
    # when all z_k are monotone in one latent; here AUROC must not move at any position.
    z, y, v = rollouts(5_000, seed=3, shared_only=True)
    temps = fit_sts(z, y, v)
    for r in position_metrics(z, y, v, temps):
        assert r["auroc_sts"] == pytest.approx(r["auroc"], abs=1e-6)


def test_temperature_depends_on_earlier_positions(fitted):
    temps, (z, y, v), _, _ = fitted
    zs, ys, vs = z[:, :2], y[:, :2], v[:, :2]
    # Pinning T_1 at the fitted value reproduces the free fit; pinning it elsewhere moves T_2 to
    # compensate (a colder T_1 leaves less overconfidence for T_2 to absorb, and vice versa).
    assert fit_sts(zs, ys, vs, fixed=[temps[0].item()])[1] == temps[1]
    t2_cold = fit_sts(zs, ys, vs, fixed=[1.0])[1].item()
    t2_hot = fit_sts(zs, ys, vs, fixed=[10.0])[1].item()
    assert t2_cold > temps[1].item() > t2_hot


def test_fit_is_deterministic_and_skips_empty_positions():
    z, y, v = rollouts(3_000, seed=4)
    v[:, -1] = False
    a = fit_sts(z, y, v)
    b = fit_sts(z.clone(), y.clone(), v.clone())
    assert torch.equal(a, b)
    assert a[-1].item() == 1.0
    assert bool((a > 0).all())


def test_soft_labels_path_reduces_ece():
    z, y, v = teacher_forced(12_000, seed=5)
    temps = fit_sts(z, y, v)
    zh, yh, vh = teacher_forced(12_000, seed=6)
    s = summary(position_metrics(zh, yh, vh, temps))
    print(f"\nsoft: T = {[round(t, 3) for t in temps.tolist()]} {s}")
    assert s["ece_raw_mean"] > 0.05
    assert s["ece_sts_mean"] < 0.005  # soft labels carry no Bernoulli noise: tighter than binary


def test_binary_ece_matches_torchmetrics():
    g = torch.Generator().manual_seed(7)
    pred = torch.rand(5_000, generator=g)
    # Include exact bin edges and the endpoints, where bucketing conventions could diverge.
    pred[:32] = torch.linspace(0, 1, 16).repeat(2)
    label = (torch.rand(5_000, generator=g) < pred**2).float()
    ref = float(binary_calibration_error(pred, label.long(), n_bins=15, norm="l1"))
    assert expected_calibration_error(pred, label) == pytest.approx(ref, abs=1e-7)
    # The direct (soft-label) computation agrees with torchmetrics on binary labels.
    assert float(_ece_l1(pred, label, 15)) == pytest.approx(ref, abs=1e-6)
    # Soft labels: ECE against E[label] of a calibrated predictor is ~0.
    assert expected_calibration_error(pred, pred.clamp(0.001, 0.999)) < 2e-3


def test_auroc_nan_with_one_class():
    z = torch.randn(50, 2)
    y = torch.ones(50, 2)
    rows = position_metrics(z, y, torch.ones(50, 2, dtype=torch.bool))
    assert math.isnan(rows[0]["auroc"])


def test_cumulative_confidence_log_space():
    z = torch.full((1, 64), -30.0)
    a = cumulative_confidence(z)
    assert bool((a >= 0).all()) and a[0, 0] > 0
    t = torch.tensor([2.0, 0.5, 1.0])
    zz = torch.randn(4, 3)
    expected = torch.cumprod(torch.sigmoid(zz / t), dim=1)
    assert torch.allclose(cumulative_confidence(zz, t), expected, atol=1e-6)


def test_calibration_json_round_trip(tmp_path, fitted):
    cal = Calibration(fitted[0].tolist() + [1 / 3, 0.1 + 0.2])
    assert Calibration.from_dict(cal.to_dict()) == cal
    path = cal.save(tmp_path / "ckpt" / "calibration.json")
    assert Calibration.load(path).temperatures == cal.temperatures  # exact float equality
    assert DrafterFolder(tmp_path / "ckpt").write_calibration(cal) == path  # the folder's file name
    assert load_calibration(tmp_path / "ckpt").temperatures == cal.temperatures  # a folder or its file
    assert sorted(p.name for p in path.parent.iterdir()) == ["calibration.json"]  # no temp leftovers
    z = torch.randn(3, len(cal.temperatures))
    assert torch.equal(cal.cumulative(z), cumulative_confidence(z, cal.temperatures))


def test_reliability_bins_and_diagram(tmp_path, fitted):
    temps, _, (z, y, v), _ = fitted
    rb = reliability_bins(torch.tensor([0.0, 0.05, 0.5, 1.0]), torch.tensor([0.0, 1.0, 1.0, 1.0]), 10)
    assert rb.counts.tolist() == [2, 0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert rb.mean_label[0].item() == 0.5 and math.isnan(rb.mean_pred[1].item())

    data = reliability_data(z[:4000], y[:4000], v[:4000], temps)
    png = reliability_diagram(data, tmp_path / "plots" / "reliability.png", positions=[1, 3, 5, 7])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    blob = json.loads(png.with_suffix(".json").read_text())
    assert [r["position"] for r in blob["positions"]] == [1, 3, 5, 7]
    assert sum(blob["positions"][0]["raw"]["counts"]) == blob["positions"][0]["count"]


SHIFT = 0.8  # confidence logits too high by a constant: what a temperature cannot undo


def shifted_rollouts(n: int, seed: int):
    """Engine rounds whose logits are the true log-odds plus ``SHIFT`` at every position: confidences
    too high across the whole range, as on benchmark rounds of a drafter trained on other data."""
    z, y, v = rollouts(n, seed)
    return z / OVERCONFIDENCE + SHIFT, y, v


def test_sts_with_offsets_fixes_a_shift_that_sts_cannot():
    z, y, v = shifted_rollouts(20_000, seed=7)
    zh, yh, vh = shifted_rollouts(20_000, seed=8)
    sts = Calibration.fit(z, y, v)
    both = Calibration.fit(z, y, v, offsets=True)
    assert sts.offsets is None and sts.method == "sts" and both.method == "sts_offsets"
    s_sts, s_both = (summary(position_metrics(zh, yh, vh, c)) for c in (sts, both))
    print(f"\nSTS {s_sts['ece_sts_mean']:.4f}, with offsets {s_both['ece_sts_mean']:.4f}: {both}")
    assert s_both["ece_sts_mean"] < 0.012 < 0.04 < s_sts["ece_sts_mean"] <= s_sts["ece_raw_mean"]
    rows = position_metrics(zh, yh, vh, both)
    assert [r["offset"] for r in rows] == both.offsets and "offset" not in position_metrics(zh, yh, vh, sts)[
        0
    ]
    # The first position's pair undoes the planted shift; later ones absorb what their prefix leaves.
    assert both.offsets[0] == pytest.approx(-SHIFT, abs=0.15) and both.temperatures[0] == pytest.approx(
        1, rel=0.2
    )
    # Rankings are kept: each c_k is a monotone map of z_k, so position 1's AUROC does not move.
    assert rows[0]["auroc_sts"] == pytest.approx(rows[0]["auroc"], abs=1e-6)


def test_sts_with_offsets_on_data_that_needs_only_a_temperature():
    """Plain overconfidence (logits ×3): the offsets stay near 0, the temperatures near 3, and the
    held-out ECE is as low as STS's; positions without data or with one class keep (1, 0)."""
    z, y, v = rollouts(20_000, seed=9)
    temps, offsets = fit_sts_offsets(z, y, v)
    assert torch.allclose(temps, torch.full_like(temps, OVERCONFIDENCE), rtol=0.3)
    assert float(offsets.abs().max()) < 0.3
    zh, yh, vh = rollouts(20_000, seed=10)
    both, sts = Calibration(temps.tolist(), offsets.tolist()), Calibration(fit_sts(z, y, v).tolist())
    ece = [summary(position_metrics(zh, yh, vh, c))["ece_sts_mean"] for c in (sts, both)]
    assert ece[1] < ece[0] + 0.003
    v[:, -1] = False
    y[:, -2] = 0.0
    temps, offsets = fit_sts_offsets(z, y, v)
    assert temps[-2:].tolist() == [1.0, 1.0] and offsets[-2:].tolist() == [0.0, 0.0]
    assert torch.equal(fit_sts_offsets(z, y, v)[0], temps)  # deterministic


def test_calibration_with_offsets_round_trip_and_bad_files(tmp_path):
    cal = Calibration([0.5, 2.0, 1.0], [-0.3, 0.0, 1.25])
    assert cal.to_dict() == {
        "method": "sts_offsets",
        "temperatures": [0.5, 2.0, 1.0],
        "offsets": [-0.3, 0.0, 1.25],
    }
    assert Calibration.load(cal.save(tmp_path / "c.json")) == cal
    z = torch.randn(5, 3)
    torch.testing.assert_close(
        cal.cumulative(z),
        torch.sigmoid(z / torch.tensor([0.5, 2.0, 1.0]) + torch.tensor([-0.3, 0.0, 1.25])).cumprod(-1),
    )
    with pytest.raises(ValueError, match="need 3 finite offsets"):
        Calibration([0.5, 2.0, 1.0], [0.0, 1.0])
    for bad in (
        {"method": "sts_offsets", "temperatures": [1.0]},
        {"method": "sts", "temperatures": [1.0], "offsets": [0.0]},
    ):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(DataError, match="bad.json is not a calibration file .*delete it or refit it"):
            Calibration.load(tmp_path / "bad.json")


def test_ece_noise_floor_is_the_ece_of_perfect_calibration():
    """Labels drawn from the confidences themselves: the ECE they show averages the floor (within
    Monte-Carlo error), and the floor shrinks as 1/sqrt(n)."""
    g = torch.Generator().manual_seed(11)
    p = torch.sigmoid(1.5 * torch.randn(5_000, generator=g, dtype=torch.float64))
    draws = [
        expected_calibration_error(p, (torch.rand(p.shape, generator=g, dtype=torch.float64) < p).double())
        for _ in range(200)
    ]
    floor = ece_noise_floor(p)
    assert sum(draws) / len(draws) == pytest.approx(floor, rel=0.05)
    assert ece_noise_floor(p.repeat(4)) == pytest.approx(floor / 2, rel=1e-6)
    assert math.isnan(ece_noise_floor(torch.empty(0)))
    z, y, v = rollouts(4_000, seed=12)
    rows = position_metrics(z, y, v, fit_sts(z, y, v))
    # Overconfident raw confidences sit far above their floor; fitted in-sample, STS reaches it.
    assert all(
        r["ece_raw"] > 5 * r["ece_raw_floor"] and r["ece_sts"] < 1.6 * r["ece_sts_floor"] for r in rows
    )
    z, y, v = teacher_forced(2_000, seed=13)
    assert (
        "ece_sts_floor" not in position_metrics(z, y, v, [1.0] * GAMMA)[0]
    )  # soft labels: no Bernoulli noise


def _round_records(z: torch.Tensor, y: torch.Tensor, per_request: int = 20) -> list[dict]:
    """Engine round records (rounds.jsonl's fields) of full blocks: accepted = the labels' leading run."""
    accepted = y.clamp(min=0).long().cumprod(1).sum(1)
    return [
        {"request": f"b/{i // per_request}", "round": i % per_request, "drafted": GAMMA, "proposed": GAMMA,
         "accepted": int(accepted[i]), "confidence_logits": z[i].tolist()}
        for i in range(len(z))
    ]  # fmt: skip


def test_compare_cli_scores_each_method_where_it_was_not_fitted(tmp_path):
    import gzip

    from dspark.reporting.calibration_compare import compare, fold_of, main

    z, y, _ = shifted_rollouts(8_000, seed=14)  # whole blocks: every position labelled
    path = tmp_path / "rounds.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in _round_records(z, y))
    report = main([str(path), "--folds", "3", "--out", str(tmp_path / "cmp.json")])
    res = report["sources"][str(path)]
    assert json.loads((tmp_path / "cmp.json").read_text()) == report and "commit" in report
    assert res["rounds"] == 8_000 and res["folds"] == 3 and len(res["fits"]["sts_offsets"]) == 3
    m = res["methods"]
    assert set(m) == {"raw", "sts", "sts_offsets"} and all(len(v["ece"]) == GAMMA for v in m.values())
    assert m["sts_offsets"]["ece_mean"] < m["sts"]["ece_mean"] < m["raw"]["ece_mean"]
    assert m["sts_offsets"]["ece_mean"] < 2 * m["sts_offsets"]["ece_floor_mean"]
    # A request's rounds stay in one fold, and the folds are stable across runs.
    assert len({fold_of(f"b/{i}", 3) for i in range(40)}) == 3 and fold_of("b/7", 3) == fold_of("b/7", 3)
    with pytest.raises(ConfigError, match="--folds 1: need at least 2"):
        compare(_round_records(z, y)[:100], folds=1)
    with pytest.raises(DataError, match="do not fill 3 folds"):
        compare(_round_records(z, y)[:20], folds=3)  # one request only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fits_and_metrics_on_cuda_match_the_cpu():
    """Training validation fits STS on the model's device (CalibrationCallback): the same temperatures,
    offsets and metrics as on the CPU, up to float rounding of the ECE's sums."""
    for z, y, v in (rollouts(20_000, seed=1), teacher_forced(12_000, seed=5)):
        cuda = [t.to("cuda") for t in (z, y, v)]
        temps = fit_sts(z, y, v)
        torch.testing.assert_close(fit_sts(*cuda).cpu(), temps, rtol=0.05, atol=0)  # adjacent grid points
        for ours, ref in zip(fit_sts_offsets(*cuda), fit_sts_offsets(z, y, v)):
            torch.testing.assert_close(ours.cpu(), ref, rtol=1e-3, atol=1e-4)
        on_cpu, on_cuda = position_metrics(z, y, v, temps), position_metrics(*cuda, temps)
        for a, b in zip(on_cpu, on_cuda):
            assert a.keys() == b.keys()
            for key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5, nan_ok=True), key
