"""python -m dspark.schedule: analytical replay of recorded rounds (exact τ, the frontier dominance
of Algorithm 1 over fixed γ on a roofline), the CLI's files and errors, and measured mode on the
tiny target."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, load_group
from hydra import compose, initialize_config_module

from dspark.core.errors import ConfigError
from dspark.scheduling.cost import CostModel
from dspark.scheduling.policies import build_policy
from dspark.scheduling.replay import (
    ReplayError,
    dominance,
    load_rounds,
    replay,
    rounds_from_records,
    stream_batches,
)

FILES = ("frontier.json", "fig7_frontier.png", "fig7_frontier.json", "fig8_budget.png", "fig8_budget.json")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def record(req, rnd, conf, n, gamma=None, proposed=None, bench="syn"):
    gamma = len(conf) if gamma is None else gamma
    proposed = gamma if proposed is None else proposed
    return {
        "benchmark": bench,
        "request": req,
        "round": rnd,
        "step": 0,
        "batch": 1,
        "anchor_pos": 0,
        "drafted": gamma,
        "proposed": proposed,
        "accepted": min(n, proposed),
        "emitted": min(n, proposed) + 1,
        "accept_flags": [k < n for k in range(proposed)],
        "confidence_logits": None,
        "confidence": list(conf),
    }


# Every request replays the same 5 rounds with first rejections n = 0..4 (γ = 4), so any window of
# a multiple of 5 steps shows each slot every round equally often, whatever the slot offsets.
N_SEQ = [0, 1, 2, 3, 4]
CONF = [
    [0.9, 0.8, 0.5, 0.4],
    [0.95, 0.9, 0.9, 0.2],
    [0.6, 0.6, 0.6, 0.6],
    [0.99, 0.1, 0.9, 0.9],
    [0.5, 0.5, 0.5, 0.5],
]


def periodic_records(requests=3):
    return [record(f"r{q}", k, CONF[k], N_SEQ[k]) for q in range(requests) for k in range(5)]


def calibrated_records(requests=40, gamma=5, seed=0):
    """Outcomes drawn from the confidences themselves: perfectly calibrated c_k."""
    rng = np.random.default_rng(seed)
    recs = []
    for q in range(requests):
        level = rng.uniform(0.35, 0.97)
        for k in range(int(rng.integers(4, 25))):
            c = np.clip(level + rng.normal(0, 0.12, gamma), 0.02, 0.99)
            ok = rng.random(gamma) < c
            recs.append(record(f"r{q}", k, c.tolist(), int(np.argmin(ok)) if not ok.all() else gamma))
    return recs


def write_jsonl(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


# ---------------------------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------------------------
def test_replay_exact_tau_fixed_mtp1_threshold():
    rounds = rounds_from_records(periodic_records())
    flat = CostModel({1: 10.0, 4096: 10.0})  # 10 ms whatever B: throughput = R·τ / 10 ms
    specs = ["fixed", "fixed_2", "mtp1", "threshold_0.5", "hardware_aware"]
    pols = {s: build_policy(s, gamma=4) for s in specs}
    front = replay(rounds, pols, flat, [1, 3], steps=50, warmup=2, seed=3)
    # τ' = min(ℓ', n) + 1 averaged over n = 0..4.
    a = np.cumprod(np.array(CONF), axis=1)
    thr_len = (np.cumprod(a >= 0.5, axis=1)).sum(axis=1)
    want = {
        "fixed": (np.mean(N_SEQ) + 1, 4),
        "fixed_2": (np.mean(np.minimum(N_SEQ, 2)) + 1, 2),
        "mtp1": (np.mean(np.minimum(N_SEQ, 1)) + 1, 1),
        "threshold_0.5": (np.mean(np.minimum(N_SEQ, thr_len)) + 1, thr_len.mean()),
        # a flat cost makes every live candidate worth admitting: Algorithm 1 verifies everything
        "hardware_aware": (np.mean(N_SEQ) + 1, 4),
    }
    assert want["fixed"][0] == 3.0 and want["mtp1"][0] == 1.8
    for name, (tau, budget) in want.items():
        for p in front[name]:
            R = p["concurrency"]
            assert p["tau"] == pytest.approx(tau, abs=1e-12), name
            assert p["budget"] == pytest.approx(budget, abs=1e-12), name
            assert p["throughput"] == pytest.approx(R * tau / 0.010, rel=1e-12), name
            assert p["tps_per_user"] == pytest.approx(tau / 0.010, rel=1e-12), name
    # Expected outcomes: τ = 1 + Σ_{j<=ℓ} a_j, averaged over the rounds.
    exp = replay(rounds, {"fixed_2": build_policy("fixed_2")}, flat, [3], steps=50, outcome="expected")
    assert exp["fixed_2"][0]["tau"] == pytest.approx(1 + a[:, :2].sum(axis=1).mean(), abs=1e-12)


def test_stream_batches_keep_requests_in_order_and_distinct():
    seqs = [np.arange(10 * s, 10 * s + 4) for s in range(6)]
    rng = np.random.default_rng(0)
    prev = None
    for idx in stream_batches(seqs, 4, 40, rng):
        assert len(set((idx // 10).tolist())) == 4  # distinct requests while the pool allows
        if prev is not None:  # a slot either moves to its request's next round or starts a new one
            assert all(b == a + 1 or b % 10 == 0 for a, b in zip(prev, idx))
        prev = idx
    big = list(stream_batches(seqs, 9, 3, np.random.default_rng(1)))  # R > requests: repeats allowed
    assert all(len(b) == 9 for b in big)


def test_hardware_aware_dominates_fixed_gamma_on_a_roofline():
    gamma = 5
    rounds = rounds_from_records(calibrated_records(gamma=gamma))
    cost = CostModel.analytical(base_ms=10.0, knee=64)
    fixed = ["mtp1"] + [f"fixed_{g}" for g in range(2, gamma + 1)]
    pols = {s: build_policy(s, gamma=gamma) for s in fixed + ["hardware_aware"]}
    conc = [1, 4, 16, 64, 128]
    # Provable part: on a roofline Θ along Algorithm 1's path is unimodal (flat, then a mediant of
    # concave gains over an affine time), so its stop is the path's maximum, and Σ of the top-n
    # prefix survivals bounds any fixed allocation with n tokens. Hence, in expectation (calibrated
    # confidences), every single batch's Θ under hardware_aware >= under any fixed γ.
    exp = replay(rounds, pols, cost, conc, steps=60, outcome="expected", per_batch=True)
    for name in fixed:
        for p, q in zip(exp["hardware_aware"], exp[name]):
            ha = np.array([t / s for t, s in p["batches"]])
            fx = np.array([t / s for t, s in q["batches"]])
            assert (ha >= fx * (1 - 1e-12)).all(), (name, p["concurrency"])
    # Measured part, recorded outcomes: the frontier points of every fixed γ are matched or beaten.
    rec = replay(rounds, pols, cost, conc, steps=150)
    assert dominance(rec, "hardware_aware", fixed) == []
    ha = {p["concurrency"]: p for p in rec["hardware_aware"]}
    for name in fixed:
        for p in rec[name]:
            assert ha[p["concurrency"]]["throughput"] >= p["throughput"] * (1 - 1e-9), (name, p)
    # and it is load-adaptive: the budget shrinks once the batch is compute-bound
    budgets = [p["budget"] for p in rec["hardware_aware"]]
    assert budgets[0] > 3 and budgets[-1] < budgets[0] / 2


def test_replay_recalibrates_from_the_recorded_logits():
    """calibration= replaces the recorded confidences by σ(z / T + b) of the recorded logits: bare STS
    temperatures (b = 0) or a Calibration with offsets."""
    from dspark.calibration.sts import Calibration

    recs = periodic_records()
    for r in recs:
        r["confidence_logits"] = [math.log(c / (1 - c)) for c in r["confidence"]]
    z = np.array([r["confidence_logits"] for r in recs])
    temps, offsets = [0.5, 1.0, 2.0, 4.0], [0.3, -0.2, 0.0, 1.0]
    sts = rounds_from_records(recs, calibration=temps).confidence
    both = rounds_from_records(recs, calibration=Calibration(temps, offsets)).confidence
    np.testing.assert_allclose(sts, 1 / (1 + np.exp(-z / temps)), rtol=1e-6)
    np.testing.assert_allclose(both, 1 / (1 + np.exp(-(z / temps + offsets))), rtol=1e-6)
    np.testing.assert_allclose(rounds_from_records(recs).confidence, np.array(CONF * 3), rtol=1e-6)


def test_rounds_must_be_recorded_at_full_gamma(tmp_path):
    recs = periodic_records()
    recs[4] = record("r0", 4, CONF[4], 2, gamma=4, proposed=2)
    with pytest.raises(ReplayError, match=r"1 of 15 rounds verified fewer.*policy.gamma=null"):
        rounds_from_records(recs)
    bad = periodic_records()
    bad[1]["accepted"] = 3  # flags say 1
    with pytest.raises(ReplayError, match="inconsistent outcome"):
        rounds_from_records(bad)
    with pytest.raises(ReplayError, match="no rounds.jsonl"):
        load_rounds(tmp_path)
    no_conf = [dict(r, confidence=None) for r in periodic_records()]
    r = rounds_from_records(no_conf)
    with pytest.raises(ReplayError, match="no confidences"):
        replay(r, {"hardware_aware": build_policy("hardware_aware")}, CostModel.analytical(), [1], steps=2)
    assert replay(r, {"fixed": build_policy("fixed")}, CostModel.analytical(), [1], steps=5)["fixed"]
    with pytest.raises(ConfigError, match="exceeds"):
        build_policy("fixed_9", gamma=4)
    with pytest.raises(ConfigError, match="unknown policy"):
        build_policy("greedy", gamma=4)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def _cfg(overrides):
    with initialize_config_module(config_module="dspark.conf", version_base="1.3"):
        return compose(config_name="schedule", overrides=overrides)


def test_cli_analytical_writes_frontier_and_plots(tmp_path):
    rounds = write_jsonl(tmp_path / "rounds.jsonl", calibrated_records(requests=20))
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "dspark.schedule",
        "mode=analytical",
        f"rounds={rounds}",
        "cost_table=null",
        "concurrency=[1,8,64,256]",
        "replay.steps=40",
        "progress=false",
        f"out_dir={out}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SYNTHETIC" in proc.stdout + proc.stderr
    for f in FILES + ("meta.json",):
        assert (out / f).stat().st_size > 0, f
    front = json.loads((out / "frontier.json").read_text())
    assert set(front) == {"mode", "cost_table", "policies"} and front["mode"] == "analytical"
    assert CostModel.from_dict(front["cost_table"]).meta["analytical"]["knee"] == 256
    assert list(front["policies"]) == [
        "mtp1",
        "fixed_3",
        "fixed",
        "threshold",
        "hardware_aware",
        "async_topk",
    ]
    for pts in front["policies"].values():
        assert [p["concurrency"] for p in pts] == [1, 8, 64, 256]
        for p in pts:
            assert set(p) == {"concurrency", "throughput", "tps_per_user", "budget", "tau"}
            assert p["tps_per_user"] == pytest.approx(p["throughput"] / p["concurrency"])
    fig7 = json.loads((out / "fig7_frontier.json").read_text())
    assert fig7["dominance"]["policy"] == "hardware_aware" and fig7["policies"] == front["policies"]
    assert json.loads((out / "fig8_budget.json").read_text())["policies"] == front["policies"]

    # a given cost table is used as is; in-process from here on (no interpreter start-up)
    from dspark.schedule import run

    table = CostModel({1: 5.0, 64: 5.0, 512: 40.0}).save(tmp_path / "cost.json")
    res = run(
        _cfg(
            [
                f"rounds={tmp_path}",
                f"cost_table={table}",
                "concurrency=[2,32]",
                "replay.steps=10",
                "policies=[mtp1,hardware_aware]",
                "progress=false",
                f"out_dir={tmp_path / 'o2'}",
            ]
        )
    )
    assert res["cost_table"]["verify_ms"] == {"1": 5.0, "64": 5.0, "512": 40.0}
    assert json.loads((tmp_path / "o2" / "frontier.json").read_text()) == json.loads(json.dumps(res))


def test_cli_errors_are_one_line(tmp_path):
    from dspark.schedule import run

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspark.schedule",
            f"rounds={tmp_path / 'nope'}",
            f"hydra.run.dir={tmp_path}/h",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("dspark: error: rounds=") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1

    short = periodic_records()
    short[0] = record("r0", 0, CONF[0], 0, gamma=4, proposed=1)
    write_jsonl(tmp_path / "rounds.jsonl", short)
    base = [f"rounds={tmp_path}", "progress=false", f"out_dir={tmp_path / 'o'}", "replay.steps=2"]
    with pytest.raises(ConfigError, match="verified fewer draft tokens than drafted"):
        run(_cfg(base))
    write_jsonl(tmp_path / "rounds.jsonl", periodic_records())
    (tmp_path / "bad.json").write_text(
        json.dumps({"format": "dspark.cost_model/v1", "verify_ms": {"1": 10, "64": 2}})
    )
    with pytest.raises(ConfigError, match=r"cost_table=.*decreases with batch size"):
        run(_cfg(base + [f"cost_table={tmp_path / 'bad.json'}"]))
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ConfigError, match="not a valid cost table"):
        run(_cfg(base + [f"cost_table={tmp_path / 'junk.json'}"]))
    with pytest.raises(ConfigError, match="no such file"):
        run(_cfg(base + [f"cost_table={tmp_path / 'missing.json'}"]))
    with pytest.raises(ConfigError, match="gamma=6 exceeds"):
        run(_cfg(base + ["gamma=6"]))
    with pytest.raises(ConfigError, match="unknown policy"):
        run(_cfg(base + ["policies=[fixed,greedy]"]))
    with pytest.raises(ConfigError, match="drafter_dir is required"):
        run(_cfg(["mode=measured", f"out_dir={tmp_path / 'o'}"]))


@pytest.fixture
def one_thread():
    # On a shared 2-core box, two intra-op threads competing with other jobs make each tiny
    # forward 10-30x slower (threads spin waiting for a descheduled peer); one thread does not.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_measured_mode_tiny_target(tiny_target, tmp_path, one_thread, caplog):
    from dspark.checkpoints import save_drafter
    from dspark.core.types import TargetDims
    from dspark.drafters import build_drafter
    from dspark.schedule import run

    dc, hc = load_group("drafter", "dspark"), load_group("head", "markov")
    dc.num_layers, dc.block_size, hc.rank = 1, 4, 32
    torch.manual_seed(0)
    drafter = tmp_path / "drafter"
    save_drafter(build_drafter(TargetDims.of(tiny_target), dc, hc), drafter, dc, hc, tiny_target.describe())
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "gsm8k.jsonl").write_text(
        "".join(json.dumps({"turns": [q]}) + "\n" for q in ["What is 2+3?", "Add 4 and 9."])
    )
    out = tmp_path / "out"
    res = run(
        _cfg(
            [
                "mode=measured",
                "target=tiny",
                f"drafter_dir={drafter}",
                "concurrency=[1,2]",
                "policies=[fixed,hardware_aware]",
                "measured.benchmarks=[gsm8k]",
                f"measured.benchmark_dir={bench}",
                "measured.max_new_tokens=8",
                "context_len=16",
                "profile.batch_sizes=[1,4,10]",
                "profile.repeats=1",
                "profile.warmup=1",
                "measured.warmup=false",
                "progress=false",
                f"out_dir={out}",
            ]
        )
    )
    for f in FILES + ("cost_table.json", "meta.json"):
        assert (out / f).stat().st_size > 0, f
    assert res["mode"] == "measured"
    cost = CostModel.load(out / "cost_table.json")
    assert sorted(cost.verify_ms) == [1, 4, 10] and sorted(cost.draft_ms) == [1, 2]
    for name in ("fixed", "hardware_aware"):
        pts = res["policies"][name]
        assert [p["concurrency"] for p in pts] == [1, 2]
        for p in pts:
            assert p["throughput"] > 0 and p["tps_per_user"] > 0 and 1 <= p["tau"] <= 5
    assert all(p["budget"] == 4 for p in res["policies"]["fixed"])
    # the engine's own RoundRecords replay as they are; a partial-block run is refused
    from dspark.decoding.engine import Engine
    from dspark.scheduling.policies import Fixed

    prompt = [tiny_target.chat_ids([{"role": "user", "content": "Hi"}])]
    full = Engine.from_checkpoint(tiny_target, drafter, Fixed(None), max_new_tokens=4).generate(prompt)
    rounds = rounds_from_records(full.rounds)
    assert rounds.gamma == 4 and rounds.confidence.shape == (len(full.rounds), 4)
    part = Engine.from_checkpoint(tiny_target, drafter, Fixed(2), max_new_tokens=4).generate(prompt)
    with pytest.raises(ReplayError, match="verified fewer"):
        rounds_from_records(part.rounds)
    # measured.draft_vocab: the profiled draft steps and the engines serve the drafter over its most
    # frequent answer tokens (its folder's counts), which the cost table and the figures' data record
    from dspark.artifacts import DrafterFolder

    counts = torch.zeros(tiny_target.vocab_size, dtype=torch.long)
    counts[300:400] = 1
    DrafterFolder(drafter).write_token_counts(counts)
    narrow = tmp_path / "narrow"
    res = run(
        _cfg(
            ["mode=measured", "target=tiny", f"drafter_dir={drafter}", "concurrency=[2]", "policies=[fixed]",
             "measured.benchmarks=[gsm8k]", f"measured.benchmark_dir={bench}", "measured.max_new_tokens=4",
             "measured.draft_vocab=64", "context_len=16", "profile.batch_sizes=[1,4,10]", "profile.repeats=1",
             "profile.warmup=1", "measured.warmup=false", "progress=false", f"out_dir={narrow}"]
        )
    )  # fmt: skip
    assert res["cost_table"]["meta"]["draft_vocab"]["size"] == 64
    assert json.loads((narrow / "fig7_frontier.json").read_text())["draft_vocab"]["size"] == 64
    # that table's draft steps price a run over the whole vocabulary wrongly: it is told so
    whole = ["mode=measured", "target=tiny", f"drafter_dir={drafter}", "concurrency=[2]", "policies=[fixed]",
             "measured.benchmarks=[gsm8k]", f"measured.benchmark_dir={bench}", "measured.max_new_tokens=4",
             f"cost_table={narrow / 'cost_table.json'}", "context_len=16", "measured.warmup=false",
             "progress=false", f"out_dir={tmp_path / 'whole'}"]  # fmt: skip
    with caplog.at_level("WARNING", logger="dspark.frontier.modes"):
        run(_cfg(whole))
    assert "timed with draft vocabulary {'size': 64" in caplog.text and "with None" in caplog.text


def test_settle_profile_retimes_spikes_then_smooths():
    from dspark.bench.profile import settle_profile

    calls = []

    def noisy_once(sizes):  # B=4 is disturbed on the first pass only
        calls.append(list(sizes))
        return {b: (900.0 if b == 4 and len(calls) == 1 else 10.0 + b) for b in sizes}

    table, notes = settle_profile(noisy_once, [1, 4, 16])
    assert table == {1: 11.0, 4: 14.0, 16: 26.0} and calls[1:] == [[4]] and notes == {"retimed": [4]}
    table, notes = settle_profile(
        lambda sizes: {b: {1: 5.0, 2: 9.0, 4: 7.0, 8: 20.0}[b] for b in sizes}, [1, 2, 4, 8]
    )
    assert table == {1: 5.0, 2: 8.0, 4: 8.0, 8: 20.0} and notes["raw_ms"]["2"] == 9.0
    CostModel(table)  # a valid table


def test_e2e_mode_draws_the_measured_frontier(tmp_path):
    """mode=e2e: the rows of python -m dspark.bench.e2e at one temperature become the measured
    frontier (one curve per run, target-only included), with the dominance check of hardware_aware
    against the fixed lengths only, priced with the cost table the benchmark ran with."""
    from dspark.schedule import run

    cost = CostModel({1: 4.0, 64: 5.0}, draft_ms={1: 1.0})

    def row(run_, R, t, thr, user):
        drafted = {"target_only": 0, "dspark/mtp1": 1}.get(run_, 4)  # the rounds by drafted length
        by_length = [{"rows_bucket": R, "drafted": drafted, "rounds": 10, "ms": 2.0 + drafted, "host_ms": 1.0,
                      "tokens_per_row": 1.0 + drafted / 2, "verified_per_row": 1.0 + drafted,
                      "priced_ms": 2.0}]  # fmt: skip
        return {"run": run_, "concurrency": R, "temperature": t, "throughput": thr, "tps_per_user": user,
                "budget": 1.0, "tau": 2.0, "by_length": by_length}  # fmt: skip

    rows = []
    for t in (0.0, 1.0):
        for R in (1, 16):
            rows += [
                row("target_only", R, t, 100.0 * R, 100.0),
                row("dspark/fixed", R, t, 150.0 * R, 150.0),
                row("dspark/mtp1", R, t, 120.0 * R, 120.0),
                row("dspark/hardware_aware", R, t, 160.0 * R, 160.0 - R),  # R = 16 misses fixed per user
                row("dspark/draft_aware", R, t, 170.0 * R, 170.0),
            ]
    report = tmp_path / "e2e.json"
    report.write_text(json.dumps({"rows": rows, "cost_table": cost.to_dict(), "goals": {"1": [{"x": 1}]}}))
    out = tmp_path / "front"
    with pytest.raises(ConfigError, match="e2e_temperature"):
        run(_cfg(["mode=e2e", f"e2e={report}", f"out_dir={out}"]))
    with pytest.raises(ConfigError, match="give the json"):
        run(_cfg(["mode=e2e", f"e2e={tmp_path / 'missing.json'}", f"out_dir={out}"]))
    res = run(_cfg(["mode=e2e", f"e2e={report}", "e2e_temperature=1", f"out_dir={out}"]))
    assert res["mode"] == "e2e" and CostModel.from_dict(res["cost_table"]) == cost
    assert list(res["policies"]) == ["target_only", "fixed", "mtp1", "hardware_aware", "draft_aware"]
    assert [p["concurrency"] for p in res["policies"]["draft_aware"]] == [1, 16]
    fig7 = json.loads((out / "fig7_frontier.json").read_text())
    assert fig7["dominance"]["against"] == ["fixed", "mtp1"] and not fig7["dominance"]["dominates"]
    assert fig7["temperature"] == 1.0 and fig7["goals"] == [{"x": 1}]
    for f in FILES:
        assert (out / f).stat().st_size > 0, f
    # the measured rounds against the table's price, per run and R (e2e points carry them)
    check = json.loads((out / "fig_cost_check.json").read_text())
    assert list(check["policies"]) == list(res["policies"])
    assert (out / "fig_cost_check.png").stat().st_size > 0
    mtp1 = next(r for r in rows if (r["run"], r["concurrency"], r["temperature"]) == ("dspark/mtp1", 16, 1.0))
    assert check["policies"]["mtp1"][1] == {"concurrency": 16, "by_length": mtp1["by_length"]}
