"""The benchmark scripts run end to end on the tiny target (CPU: no graph column) and write what
they promise; their numbers are measured on the GPU, never asserted here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_engine import Oracle, prompts_for
from test_evaluate import _bench, _save

from dspark.bench import e2e, engine_sps
from dspark.bench import measure as measure_mod
from dspark.bench import plans as plans_cli
from dspark.bench.measure import WARMUP_TOKENS, goal_checks, measure, rounds_by_transition, run_noise
from dspark.bench.sps import fewer_drafts_cost_no_more
from dspark.decoding.engine import Engine
from dspark.scheduling.cost import CostModel
from dspark.scheduling.policies import Fixed


def test_a_round_with_fewer_drafts_is_priced_no_higher():
    """Timing noise only adds time, and a round that drafts fewer positions does less work: a time
    above a longer draft's is lowered to it (the H200's R = 16 row, γ_d = 1, 2 above 3..7), the
    others kept as measured."""
    measured = {0: 1.08, 1: 1.62, 2: 1.69, 3: 1.47, 4: 1.50, 5: 1.55, 6: 1.57, 7: 1.59}
    assert fewer_drafts_cost_no_more(measured) == {
        0: 1.08, 1: 1.47, 2: 1.47, 3: 1.47, 4: 1.50, 5: 1.55, 6: 1.57, 7: 1.59
    }  # fmt: skip
    assert fewer_drafts_cost_no_more({2: 3.0, 5: 1.0}) == {2: 1.0, 5: 1.0}  # only the lengths given
    assert fewer_drafts_cost_no_more({}) == {}


def test_engine_sps_writes_json_and_cost_table(tiny_target, tmp_path):
    out, cost = tmp_path / "sps.json", tmp_path / "cost.json"
    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "rnn")
    report = engine_sps.main(
        ["--tokens", "1,4,8", "--widths", "1,4", "--context", "16", "--repeats", "1", "--warmup", "0",
         "--out", str(out), "--cost-table", str(cost), "--drafter-dir", str(drafter), "--overhead",
         "--rounds", "1,2", "--round-context", "8", "--round-passes", "2", "--draft-parts", "1,2",
         "--kernels", "2", "--attention-splits", "1", "target=tiny"]
    )  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["rows"] == report["rows"]
    shapes = {(r["rows"], r["width"]) for r in saved["rows"]}
    assert shapes == {(1, 1), (4, 1), (8, 1), (1, 4), (2, 4)}
    for r in saved["rows"]:
        assert r["hf_eager_ms"] > 0 and r["static_eager_ms"] > 0 and "graph_ms" not in r
    model = CostModel.load(cost)
    curve = model.verify_ms
    assert sorted(curve) == [1, 4, 8]
    # What settle_profile guarantees: no batch timed slower than a larger one by more than its 5 %
    # tolerance (re-timed, else an isotonic fit); exact order would assert the CPU's timing noise.
    times = [curve[b] for b in sorted(curve)]
    assert all(t <= 1.05 * later for i, t in enumerate(times) for later in times[i + 1 :]), times
    # The same steps per width (R rows, W wide): what a padded step of those rows costs.
    assert {w: sorted(t) for w, t in model.verify_width_ms.items()} == {1: [1, 4, 8], 4: [1, 2]}
    for r in saved["rows"]:
        assert model.verify_width_ms[r["width"]][r["rows"]] >= r["static_eager_ms"]  # running max
    assert sorted(int(r) for r in saved["draft_ms"]) == [1, 2, 4, 8]  # every row count measured
    assert sorted(model.draft_ms) == [1, 2, 4, 8] and all(v > 0 for v in model.draft_ms.values())
    # ... per drafted length too (γ = 4 in the saved drafter), the whole block being draft_ms.
    assert sorted(model.draft_len_ms) == [1, 2, 3, 4] and model.draft_len_ms[4] == model.draft_ms
    assert saved["compiled"] is False  # CPU: the fast path stays eager
    over = saved["round_overhead"]
    assert over["drafting_round_ms"] > 0 and over["plain_round_ms"] > 0
    assert model.overhead_ms == over["overhead_ms"] >= 0
    assert over["read_back_round_ms"] > 0 and model.readback_ms == over["readback_ms"] >= 0
    # --rounds: whole rounds per drafted length 0..γ and row count, which the cost table then prices.
    assert saved["round_context"] == 8
    assert sorted(int(m) for m in saved["round_len_ms"]) == [0, 1, 2, 3, 4]
    assert model.round_len_ms == {
        int(m): {int(r): t for r, t in v.items()} for m, v in saved["round_len_ms"].items()
    }
    assert all(sorted(v) == [1, 2] and min(v.values()) > 0 for v in model.round_len_ms.values())
    assert saved["round_passes"] == 2
    for r in (1, 2):  # the least of two passes, made non-decreasing in γ_d (then in R)
        by_length = [model.round_len_ms[m][r] for m in range(5)]
        assert by_length == sorted(by_length)
    assert all(v[1] <= v[2] for v in model.round_len_ms.values())
    assert model.round_time(2, 4) == pytest.approx(model.round_len_ms[4][2] * 1e-3)
    # ... and target-only decoding's rounds beside them: the floor of a plain round.
    floor = {int(r): ms for r, ms in saved["target_round_ms"].items()}
    assert sorted(floor) == [1, 2] and 0 < floor[1] <= floor[2]
    assert model.meta["target_round_ms"] == saved["target_round_ms"]  # the cost table carries it
    assert [p["rows"] for p in saved["draft_parts"]] == [1, 2]
    for part in saved["draft_parts"]:
        assert all(v > 0 for k, v in part.items() if k.endswith("_ms") and k != "sequential_head_ms")
        head = part["head_sampling_graph_ms"] - part["parallel_sampling_graph_ms"]
        assert part["sequential_head_ms"] == max(0.0, head)  # what the head adds to parallel sampling
    assert saved["attention_splits"] == []  # the kernel alone: CUDA only
    # --kernels: the verify step at widths 1 and γ + 1, the draft step, a plain round's step and
    # target-only's step beside it, each profiled (CPU ops here)
    assert [(k["step"], k["rows"], k["width"]) for k in saved["kernels"]] == [
        ("verify", 2, 1), ("verify", 2, 5), ("draft", 2, 4), ("plain", 2, 1), ("target_only", 2, 1)
    ]  # fmt: skip
    for k in saved["kernels"]:
        assert k["kernel_ms"] > 0 and k["kernels"] > 0 and k["top"]
        assert k["top"] == sorted(k["top"], key=lambda t: -t["us"]) and all(t["calls"] > 0 for t in k["top"])


def test_recompile_limit_watch_names_the_functions_dynamo_gave_up():
    """Past dynamo's recompile limit a function's new shapes run eagerly with a log line and no
    error; the watch the benchmarks run under (their ``compile_fallbacks``) names the function,
    only while it is open, and nothing below the limit."""
    import logging

    from dspark.core.compiling import RecompileLimitWatch

    def doubled(x):
        return x * 2

    def halved(x):
        return x / 2

    torch._dynamo.reset()
    with RecompileLimitWatch() as watch, torch._dynamo.config.patch(recompile_limit=2):
        within, past = (torch.compile(f, backend="eager", dynamic=False) for f in (halved, doubled))
        for n in (1, 2):
            within(torch.ones(n))
        for n in range(1, 6):
            past(torch.ones(n))
    assert len(watch.hits) == 1 and watch.hits[0].startswith("'doubled'")
    assert watch not in logging.getLogger(RecompileLimitWatch.LOGGER).handlers
    torch._dynamo.reset()


def test_e2e_compares_target_only_and_drafter(tiny_target, tmp_path, caplog):
    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "markov")
    bench = _bench(tmp_path / "bench")
    out, cost = tmp_path / "e2e.json", tmp_path / "cost.json"
    # Drafting never pays on this table: draft_aware runs plain decoding rounds. Measured at T = 1
    # (engine_sps --temperature): pricing the T = 0 runs with it is said.
    CostModel({1: 1.0, 2: 2.0, 3: 4.0, 16: 64.0}, draft_ms={1: 5.0}, meta={"temperature": 1.0}).save(cost)
    e2e.main(
        ["--drafter-dir", str(drafter), "--benchmark-dir", str(bench), "--prompts", "2",
         "--concurrency", "1,2", "--max-new-tokens", "4",
         "--policies", "fixed,mtp1,draft_aware,draft_aware:probe_every=1",
         "--temperature", "0,1", "--cost-table", str(cost), "--repeats", "2", "--out", str(out),
         "target=tiny"]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["waves"] == 1  # the default: one batch of R requests
    assert report["pipeline"] == 1 and report["host_load_us"] == 0  # one round ahead, no diagnostic load
    assert report["compile_fallbacks"] == []  # nothing compiled on the CPU, nothing given up
    assert all(set(c) == {"kernel", "key", "runs"} for c in report["kernel_checks"])  # the self-checks run
    assert report["repeats"] == 2 and all(len(r["repeats"]) == 2 for r in report["rows"])
    for r in report["rows"]:  # each repeat says where its slowest round was
        assert all(rep["slowest_round"]["ms"] == rep["max_ms_round"] for rep in r["repeats"])
    rows = report["rows"]
    probed = []  # the drafted lengths of the probing variant's rounds, run by run
    # a policy's variant (``name:argument=value``) runs beside it under its own name
    runs = [
        "target_only",
        "dspark/fixed",
        "dspark/mtp1",
        "dspark/draft_aware",
        "dspark/draft_aware:probe_every=1",
    ]
    assert [(r["temperature"], r["run"], r["concurrency"]) for r in rows] == [
        (t, run, R) for t in (0.0, 1.0) for R in (1, 2) for run in runs
    ]
    for r in rows:
        assert r["throughput"] > 0 and r["tau"] >= 1 and r["rounds"] > 0 and r["ms_per_round"] > 0
        assert r["tau_se"] >= 0 and (r["run"] != "target_only" or r["tau_se"] == 0)  # τ = 1 for all
        assert r["median_ms_per_round"] > 0 and r["max_ms_round"] >= r["median_ms_per_round"]
        slow = r["slowest_round"]  # the record of the round behind max_ms_round
        assert slow["ms"] == r["max_ms_round"] and 0 <= slow["index"] < slow["of"] == r["rounds"]
        assert slow["batch"] >= 1 and slow["host_ms"] > 0
        assert isinstance(slow["events_near"], dict) and isinstance(r["events"], dict)
        assert r["host_ms_per_round"] > 0 and r["wait_ms_per_round"] >= 0
        # the host's cycle holds a launch, a completion and the work between rounds (the engine's tests)
        assert 0 <= r["between_ms_per_round"] < r["cycle_ms_per_round"]
        # the policy's calls are part of the host's work, and there are none without a drafter
        assert 0 <= r["policy_ms_per_round"] < r["host_ms_per_round"]
        assert (r["policy_ms_per_round"] > 0) == (r["run"] != "target_only")
        assert all(0 <= g["policy_ms"] < g["host_ms"] for g in r["by_length"])
        assert 0 < r["launch_ms_per_round"] < r["host_ms_per_round"]  # launching is part of it, not all
        # ... and its parts add up to it, in the run's means and per drafted length
        assert sum(r["launch_parts_per_round"].values()) == pytest.approx(r["launch_ms_per_round"])
        for g in r["by_length"]:
            assert sum(g["launch_parts"].values()) == pytest.approx(g["launch_ms"])
            assert (g["launch_parts"]["draft"] > 0) == (g["drafted"] > 0)
        assert r["readback_ms_per_round"] == 0  # no policy here reads its width back
        assert r["gpu_ms_per_round"] is None and r["gap_ms_per_round"] is None  # no device clock
        if r["run"] == "target_only":
            assert r["tau"] == 1
        else:
            assert r["speedup_per_user"] > 0
        assert sum(g["rounds"] for g in r["by_length"]) == r["rounds"]  # every round, priced
        assert sum(g["rounds"] for g in r["by_transition"]) == r["rounds"] - 1  # each after the one before
        if r["run"] == "dspark/draft_aware:probe_every=1":  # a probe after each plain round: it drafts
            # (each fruitless probe doubles the wait, and the policy keeps it from run to run: which
            # runs draft depends on the ones before, so the variant's runs are judged together below)
            probed += [rep["plans"]["drafted"] for rep in r["repeats"]]
        else:
            want = {"target_only": 0, "dspark/fixed": 4, "dspark/mtp1": 1, "dspark/draft_aware": 0}[r["run"]]
            assert r["drafted_per_round"] == want  # mtp1 drafts only the position it verifies
            assert {g["drafted"] for g in r["by_length"]} == {want}
        assert all(g["priced_ms"] > 0 for g in r["by_length"])
        # round by round, under the policy that weighs drafted lengths, in each repeat (its sums in
        # the median's point)
        if "draft_aware" not in r["run"]:
            assert r["plans"] is None and all(rep["plans"] is None for rep in r["repeats"])
        elif (
            r["run"] == "dspark/draft_aware"
        ):  # the random drafter: every round plain, each of the 5 lengths weighed against it
            assert r["plans"]["plain_rounds"] == r["rounds"] and "over_plain" not in r["plans"]
            for plans in (rep["plans"] for rep in r["repeats"]):
                assert plans["drafted"] == [0] * plans["plain_rounds"]
                # a plain round is expected to emit a token per row it was planned for (a row that
                # ends in flight emits none), at the table's price times the clock's ratio
                n = len(plans["drafted"])
                assert len(plans["tokens"]) == len(plans["expected_tokens"]) == len(plans["expected_ms"]) == n
                assert all(e == int(e) >= t >= 0 for e, t in zip(plans["expected_tokens"], plans["tokens"]))
                assert all(ms > 0 for ms in plans["expected_ms"])
                pairs = zip(plans["over_plain"], plans["clock_ratio"])
                assert all(len(o) == len(c) == 5 and o[0] == 1.0 for o, c in pairs)
                assert plans["plain_declined_faster"] == sum(max(o[1:]) > 1 for o in plans["over_plain"])
                assert plans["drafting_rounds"] == plans["drafting_below_plain"] == 0
                assert plans["drafting_chosen_median"] is None
        load = r["at_load"]  # the rounds with R's rows: all at R = 1, those before the drain at R = 2
        assert 0 < load["rounds"] <= r["rounds"] and 0 < load["share"] <= 1 and load["throughput"] > 0
        assert r["concurrency"] > 1 or (load["rounds"] == r["rounds"] and load["share"] == pytest.approx(1))
        if r["run"] != "target_only":
            assert r["speedup_per_user_at_load"] > 0 and r["speedup_throughput_at_load"] > 0
    drafted = [d for run in probed for d in run]
    assert any(drafted) and 0 in drafted  # the variant drafts, and still declines to in between
    assert report["cost_table"] == CostModel.load(cost).to_dict()
    assert set(report["goals"]) == {"0", "1"} and [g["concurrency"] for g in report["goals"]["0"]] == [1, 2]
    for g in (g for t in ("0", "1") for g in report["goals"][t] if g["concurrency"] == 1):
        # at R = 1 every round is at the load: the same throughput, so the same best and speed-up
        assert g["at_load"]["best_throughput"] == g["best_throughput"]
        assert g["at_load"]["best_speedup_throughput"] == pytest.approx(g["best_speedup_throughput"])
    assert "cost table was measured at T = 1 and prices runs at T = 0,1" in caplog.text
    # python -m dspark.bench.plans reads the planning points back, run by run
    summary = plans_cli.main([str(out), "--out", str(tmp_path / "plans.json")])
    assert json.loads((tmp_path / "plans.json").read_text()) == summary
    planned = [r for r in rows if "draft_aware" in r["run"]]
    assert [(p["temperature"], p["concurrency"], p["run"]) for p in summary] == [
        (r["temperature"], r["concurrency"], r["run"]) for r in planned
    ]
    for p, r in zip(summary, planned):
        assert [x["tps_per_user"] for x in p["runs"]] == [x["tps_per_user"] for x in r["repeats"]]
        for x, rep in zip(p["runs"], r["repeats"]):  # every round at R = 1; at R = 2 not the drain's
            at_load = x["plain_at_load"] + x["drafting_at_load"]
            assert 0 < at_load <= len(rep["plans"]["drafted"])
            assert at_load == len(rep["plans"]["drafted"]) or p["concurrency"] > 1
        seqs = [rep["plans"]["rows"] for rep in r["repeats"]]
        pairs = sum(sum(a == b for a, b in zip(rows_, rows_[1:])) for rows_ in seqs)
        assert sum(s["rounds"] for s in p["switches"]) == pairs  # each round with the rows of its previous
        assert set(p["fixed_rounds"]) == {"target_only", "dspark/fixed", "dspark/mtp1"}
        assert all("after" in b and "rows" in b for rounds in p["fixed_rounds"].values() for b in rounds)
        kinds = {e["kind"] for e in p["estimates"]}  # the lengths the plans chose, each against its plan
        assert kinds and (kinds == {"plain"} or "probe_every=1" in p["run"])
        assert all(e["rounds"] > 0 and e["rate_over_expected"] > 0 for e in p["estimates"])


def test_switch_costs_set_a_round_after_the_other_kind_beside_one_after_its_own(tmp_path, capsys):
    """``bench.plans.switch_costs``: round ms by kind and the previous round's kind, over each run's
    own sequence, of rounds with the rows of the round before; a switch's price against the same
    kind after its own. ``estimate_errors``: the rounds' tokens and ms against their plans', by the
    chosen length. Bad files and arguments are refused, saying which."""
    run = {
        "drafted": [0, 0, 3, 3, 0, 0, 3, 3],
        "rows": [4, 4, 4, 4, 4, 4, 4, 3],  # the last round's rows changed: left out
        "ms": [1.0, 1.1, 3.5, 3.0, 1.4, 1.2, 3.4, 9.9],
    }
    other = {"drafted": [3, 0], "rows": [4, 4], "ms": [3.2, 1.3]}  # its first round follows nothing
    got = {(s["kind"], s["after"]): s for s in plans_cli.switch_costs([run, other], 4)}
    assert set(got) == {("plain", "plain"), ("γ3", "plain"), ("γ3", "drafting"), ("plain", "drafting")}
    plain = got[("plain", "plain")]
    assert plain["rounds"] == 2 and plain["ms_mean"] == pytest.approx(1.15)
    assert got[("γ3", "plain")]["ms_mean"] == pytest.approx(3.45) and got[("γ3", "drafting")]["rounds"] == 1
    assert got[("γ3", "plain")]["switch_ms"] == pytest.approx(0.45)  # 3.45 against 3.0
    assert got[("plain", "drafting")]["ms_mean"] == pytest.approx(1.35)  # 1.4 and the other run's 1.3
    assert got[("plain", "drafting")]["switch_ms"] == pytest.approx(0.2)
    assert got[("plain", "plain")]["switch_ms"] is None and got[("γ3", "drafting")]["switch_ms"] is None
    # a bucket other than R's is not at the load
    assert plans_cli.switch_costs([{"drafted": [0, 0], "rows": [2, 2], "ms": [1.0, 1.0]}], 4) == []
    # the plans' expectations against what the rounds did, by the chosen length; a walked round
    # (its width read back, rows verifying less than their draft) is left out
    planned = {
        "drafted": [0, 3, 3, 3], "rows": [4, 4, 4, 4], "walked": [0, 0, 0, 1], "ms": [1.0, 3.0, 3.2, 2.0],
        "tokens": [4, 8, 10, 5], "expected_tokens": [4.0, 10.0, 10.0, 10.0],
        "expected_ms": [1.0, 2.8, 2.8, 2.8],
    }  # fmt: skip
    got = {e["kind"]: e for e in plans_cli.estimate_errors([planned, run], 4)}  # ``run``: recorded before
    assert set(got) == {"plain", "γ3"} and got["γ3"]["rounds"] == 2 and got["plain"]["rounds"] == 1
    assert got["γ3"]["tokens_over_expected"] == pytest.approx(0.9)  # 18 of 20
    assert got["γ3"]["ms_over_expected"] == pytest.approx(6.2 / 5.6)
    assert got["γ3"]["rate_over_expected"] == pytest.approx(0.9 * 5.6 / 6.2)
    assert got["plain"]["rate_over_expected"] == pytest.approx(1.0)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for args, said in (
        ([str(tmp_path / "none.json")], "no such file"),
        ([str(bad)], "no 'rows' list"),
        ([str(bad), "--concurrency", "x"], "--concurrency x: give R values"),
    ):
        with pytest.raises(SystemExit):
            plans_cli.main(args)
        assert said in capsys.readouterr().err


def test_goal_checks_tell_a_tie_within_the_runs_noise_from_a_loss():
    """hardware_aware against fixed γ: "beats" at >= 1x, "ties" when short by less than how far
    the points' own repeats stray from their median (a median absolute deviation: one stalled
    repeat does not widen it), "loses" otherwise."""

    def point(run, tps, throughput, repeats):
        reps = [{"tps_per_user": tps * f, "throughput": throughput * f} for f in repeats]
        speedups = {"speedup_per_user": tps / 100, "speedup_throughput": throughput / 1000}
        return {"run": run, "concurrency": 16, "tps_per_user": tps, "throughput": throughput, **speedups,
                "repeats": reps}  # fmt: skip

    steady, noisy = (1.0, 1.001, 0.999), (1.0, 1.03, 0.97)
    for ha, repeats, verdict in [(1.01, steady, "beats"), (0.99, noisy, "ties"), (0.99, steady, "loses")]:
        rows = [
            point("target_only", 100, 1000, steady),
            point("d/fixed", 200, 1500, steady),
            point("d/hardware_aware", 200 * ha, 1500 * ha, repeats),
        ]
        (check,) = goal_checks(rows)
        assert check["hardware_aware_verdict"] == verdict
        assert check["hardware_aware_vs_fixed"] == pytest.approx(ha)
        assert check["hardware_aware_beats_fixed"] == (ha >= 1)
    stalled = point("x", 100, 1000, (1.0, 1.001, 0.2))  # one repeat hit a stall
    assert run_noise(stalled) == pytest.approx(0.001) and run_noise(point("x", 1, 1, (1.0,))) == 0


def test_a_sampled_comparison_ties_within_twice_its_tau_error():
    """At T > 0 each policy samples texts of its own: a shortfall within twice the relative error
    of the τ ratio is a tie; the same shortfall at T = 0 (one greedy text for all) is a loss."""

    def point(run, ratio, temperature, tau_se):
        reps = [{"tps_per_user": 100 * ratio, "throughput": 1000 * ratio}] * 3
        return {"run": run, "concurrency": 1, "temperature": temperature, "tps_per_user": 100 * ratio,
                "throughput": 1000 * ratio, "speedup_per_user": ratio, "speedup_throughput": ratio,
                "tau": 2.0, "tau_se": tau_se, "repeats": reps}  # fmt: skip

    for temperature, verdict in [(1.0, "ties"), (0.0, "loses")]:
        rows = [point("d/fixed", 1.5, temperature, 0.06),
                point("d/hardware_aware", 1.5 * 0.95, temperature, 0.06)]  # fmt: skip
        (check,) = goal_checks(rows)
        assert check["tau_noise"] == pytest.approx(0.03 * 2**0.5 if temperature else 0.0)
        assert check["hardware_aware_verdict"] == verdict and not check["hardware_aware_beats_fixed"]


def test_tau_standard_error_is_over_requests():
    """τ's error counts requests, not rounds: two requests that each keep one rate give a τ with
    no error however many rounds they ran, two that differ give the ratio estimator's."""
    from types import SimpleNamespace as Rec

    def rounds(request, accepted, n):
        return [Rec(request=request, accepted=accepted) for _ in range(n)]

    assert measure_mod.tau_standard_error(rounds(0, 2, 40) + rounds(1, 2, 10)) == pytest.approx(0)
    assert measure_mod.tau_standard_error(rounds(0, 2, 40)) is None  # one request: no error to tell
    recs = rounds(0, 1, 10) + rounds(1, 3, 10)  # τ 2 and 4: the mean 3, residuals ∓10 over 20 rounds
    assert measure_mod.tau_standard_error(recs) == pytest.approx((2 * 200) ** 0.5 / 20)


def test_at_load_keeps_the_rounds_of_the_loads_bucket_and_weighs_users_by_time():
    """A run at R = 4 whose last rows drain alone: the rounds with 3 or 4 live rows (R's bucket, the
    graphs of that load) are the load's, the 2- and 1-row rounds of the drain are not."""
    steps = [{"ms": 2.0, "batch": 4, "tokens": 8}, {"ms": 2.0, "batch": 3, "tokens": 9},
             {"ms": 1.0, "batch": 2, "tokens": 2}, {"ms": 1.0, "batch": 1, "tokens": 3},
             {"ms": None, "batch": 4, "tokens": 4}]  # fmt: skip
    load = measure_mod._at_load(steps, 4)
    assert load["rounds"] == 2 and load["share"] == pytest.approx(4 / 6)
    assert load["throughput"] == pytest.approx(1e3 * 17 / 4)  # tokens per second of those rounds
    assert load["tps_per_user"] == pytest.approx(1e3 * 17 / (2 * 4 + 2 * 3))  # per second a live row spent
    assert measure_mod._at_load(steps[2:4], 4) == {"rounds": 0, "share": 0.0, "throughput": None,
                                                   "tps_per_user": None}  # fmt: skip


def test_goal_checks_judge_the_load_apart_from_the_drain():
    """A policy that keeps the floor at the load R but not over a run with its drain: ``floor_met``
    says the run's, ``at_load`` the load's; without at-load speeds on every point, no verdict."""

    def point(run, user, agg, user_at, agg_at):
        return {"run": run, "concurrency": 256, "tps_per_user": user, "throughput": agg,
                "speedup_per_user": user, "speedup_throughput": agg,
                "speedup_per_user_at_load": user_at, "speedup_throughput_at_load": agg_at,
                "at_load": {"tps_per_user": user_at, "throughput": agg_at}}  # fmt: skip

    rows = [point("d/draft_aware", 0.99, 0.84, 1.01, 1.02), point("d/mtp1", 0.97, 0.83, 0.96, 0.97)]
    (check,) = goal_checks(rows)
    assert check["best_on_both"] == "draft_aware" and not check["floor_met"]
    assert check["at_load"]["best_on_both"] == "draft_aware" and check["at_load"]["floor_met"]
    assert check["at_load"]["best_on_both_speedup"] == pytest.approx(1.01)
    rows[1]["speedup_per_user_at_load"] = None
    assert goal_checks(rows)[0]["at_load"] is None


def test_e2e_keeps_the_points_of_a_run_cut_short(tiny_target, tmp_path, monkeypatch):
    """The report is written after every concurrency: a run killed by its time limit keeps what it
    finished (it used to write once per temperature, so a cut lost the whole temperature)."""
    from dspark.bench import measure

    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "markov")
    bench, out, real, calls = _bench(tmp_path / "bench"), tmp_path / "e2e.json", measure.compare, []

    def cut_at_the_second_point(*args, **kw):
        calls.append(args[3])
        if len(calls) == 2:
            raise KeyboardInterrupt  # what the time limit's signal does
        return real(*args, **kw)

    monkeypatch.setattr(measure, "compare", cut_at_the_second_point)
    with pytest.raises(KeyboardInterrupt):
        e2e.main(
            ["--drafter-dir", str(drafter), "--benchmark-dir", str(bench), "--prompts", "2", "--concurrency",
             "1,2", "--max-new-tokens", "4", "--repeats", "1", "--out", str(out), "target=tiny"]
        )  # fmt: skip
    report = json.loads(out.read_text())
    assert calls == [[1], [2]]
    assert {(r["run"], r["concurrency"]) for r in report["rows"]} == {("target_only", 1), ("dspark/fixed", 1)}
    assert [g["concurrency"] for g in report["goals"]["0"]] == [1]


# Qwen3's template in miniature: the thinking switch changes the prompt the target sees.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_every_decoding_stage_prompts_through_the_target(tiny_target, tmp_path, monkeypatch):
    """e2e, evaluate and schedule send a benchmark prompt as the same ids: the target's chat template
    with its own chat_template_kwargs (e2e used to drop them, so Qwen3 prompts differed)."""
    from omegaconf import OmegaConf

    from dspark.evaluation.evaluator import requests
    from dspark.frontier.modes import benchmark_prompts

    monkeypatch.setattr(tiny_target.tokenizer, "chat_template", THINKING_TEMPLATE)
    monkeypatch.setattr(tiny_target, "chat_template_kwargs", {"enable_thinking": False})
    bench = _bench(tmp_path / "bench")
    texts = ["What is 2+3?", "Add 4 and 9."]
    want = [tiny_target.prompt_ids(t) for t in texts]
    assert "<think>" in tiny_target.tokenizer.decode(want[0])  # the target's kwargs were applied
    assert want[0] != tiny_target.chat_ids([{"role": "user", "content": texts[0]}], enable_thinking=True)

    seen = []

    def fake_measure(target, drafter, policies, concurrency, prompts, **kw):
        seen.append(prompts)
        point = {"concurrency": 1, "throughput": 1.0, "tps_per_user": 1.0, "budget": 0.0, "tau": 1.0}
        return {name: [point] for name in policies}

    monkeypatch.setattr("dspark.target.load_target", lambda cfg: tiny_target)
    monkeypatch.setattr("dspark.bench.measure.measure", fake_measure)
    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "markov")
    e2e.main(
        ["--drafter-dir", str(drafter), "--benchmark-dir", str(bench), "--prompts", "2", "--concurrency", "1",
         "--out", str(tmp_path / "e2e.json"), "target=tiny"]
    )  # fmt: skip
    assert seen and all(prompts == want for prompts in seen)

    measured = {"benchmarks": ["gsm8k"], "benchmark_dir": str(bench), "max_prompts": 2}
    measured = OmegaConf.create({"measured": measured})
    assert benchmark_prompts(measured, tiny_target) == want
    assert [r.prompt for r in requests(tiny_target, [("gsm8k/0", texts[0]), ("gsm8k/1", texts[1])])] == want


def test_train_step_runs_the_real_step_and_agrees_across_loss_paths(tmp_path):
    """dspark.bench.train_step at a toy shape on the CPU: the real DraftingModule step (online target
    features), each variant's first-step loss, the FLOP count it divides by; no timing asserted."""
    from dspark.bench import train_step

    out = tmp_path / "step.json"
    report = train_step.main(
        ["--hidden", "32", "--layers", "5", "--vocab", "300", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "8", "--intermediate", "64", "--taps", "0,1,2", "--seq", "40", "--batch", "2",
         "--anchors", "6", "--features", "online", "--device", "cpu", "--steps", "1", "--warmup", "0",
         "--variants", "torch_loss,materialized", "--out", str(out)]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert (
        [r["variant"] for r in rows]
        == ["torch_loss", "materialized"]
        == [r["variant"] for r in report["rows"]]
    )
    assert (
        rows[1]["loss_rel_diff_vs_first"] < 1e-5
    )  # the fused (row pass in torch) and materialised losses agree
    assert set(rows[0]["flops"]) == {"draft_layers", "attention", "loss_gemms", "target_forward"}
    assert all(v > 0 for v in rows[0]["flops"].values()) and rows[0]["ms_per_step"] > 0
    assert all(r["first_step_s"] > 0 for r in rows)  # recorded, whatever it measures here


def test_train_step_on_prepared_batches(tmp_path, smoke_data):
    """--data: the step timed on a prepared folder's training batches (their lengths vary, in
    training order) with the configured target, its FLOPs averaged over those batches."""
    from conftest import smoke_run
    from hydra import compose, initialize_config_module

    from dspark.bench import train_step
    from dspark.data.dataset import ensure_dataset

    overrides = [o for o in smoke_run(tmp_path / "unused", smoke_data) if not o.startswith("out_dir=")]
    with initialize_config_module("dspark.conf", version_base="1.3"):
        cfg = compose("train", overrides)
    ensure_dataset(cfg.data, cfg.target)
    report = train_step.main(
        ["--data", str(smoke_data), "--features", "online", "--device", "cpu", "--steps", "2",
         "--warmup", "1", "--anchors", "4", "--variants", "default", "--out", str(tmp_path / "step.json"),
         *[o for o in overrides if not o.startswith("data.dir=")]]
    )  # fmt: skip
    shape, row = report["shape"], report["rows"][0]
    assert shape["target"] == "tiny" and shape["batch"] == 2 and len(shape["padded_lengths"]) == 3
    assert row["target_ms"] > 0 and row["flops"]["target_forward"] > 0


def test_measure_warms_each_run_without_changing_it(tiny_target, monkeypatch):
    """Before each timed run, an untimed one of R short requests under the same policy (a first
    use inside the timed run once cost one round 0.4-1 s on the H200); the timed run is the same
    run either way: the random stream is re-seeded after the warm-up."""
    budgets = []
    inner = Engine.generate

    def generate(self, reqs, *args, **kw):
        budgets.append({getattr(r, "max_new_tokens", None) for r in reqs})  # a raw prompt: None
        return inner(self, reqs, *args, **kw)

    monkeypatch.setattr(Engine, "generate", generate)
    drafter = Oracle(tiny_target, gamma=3)  # accepts at random: τ follows the random stream
    prompts = prompts_for(tiny_target, 3, seed=2)
    runs = {}
    for warmup in (True, False):
        out = measure(tiny_target, drafter, {"fixed": Fixed(None)}, [2], prompts, temperature=1.0,
                      max_new_tokens=24, seed=3, warmup=warmup)  # fmt: skip
        runs[warmup] = out["fixed"][0]
        if warmup:  # the warm-up of R = 2 requests, then the timed run of all three
            assert budgets[-2:] == [{WARMUP_TOKENS}, {None}]
    assert (runs[True]["tau"], runs[True]["rounds"]) == (runs[False]["tau"], runs[False]["rounds"])


def test_measure_repeats_keep_the_median_run_and_list_every_run(tiny_target, monkeypatch):
    """repeats=3: three timed runs from the same seed (the same rounds under a stateless policy);
    the point is the run of median throughput, whose one-off stall (here a slow clock in one run)
    neither sets the point nor disappears from the record."""
    drafter = Oracle(tiny_target, gamma=3)
    prompts = prompts_for(tiny_target, 2, seed=4)
    inner, calls = Engine.generate, []

    def generate(self, reqs, *args, **kw):
        res = inner(self, reqs, *args, **kw)
        if all(getattr(r, "max_new_tokens", None) is None for r in reqs):  # a timed run
            calls.append(len(calls))
            slow = {0: 1e3, 1: 4e4, 2: 2e3}.get(calls[-1], 0.0)  # ms per round: over the CPU's noise
            for s in res.steps:
                s["ms"] += slow
        return res

    monkeypatch.setattr(Engine, "generate", generate)
    out = measure(tiny_target, drafter, {"fixed": Fixed(None)}, [2], prompts, temperature=1.0,
                  max_new_tokens=16, seed=5, warmup=False, repeats=3)["fixed"][0]  # fmt: skip
    assert len(calls) == 3 and len(out["repeats"]) == 3
    speeds = [r["throughput"] for r in out["repeats"]]
    assert speeds[1] < speeds[2] < speeds[0]  # the runs in order: +1 s, +40 s, +2 s per round
    assert out["throughput"] == speeds[2]  # the median run, not the stalled one nor the fastest
    assert out["repeats"][1]["max_ms_round"] > out["max_ms_round"]  # the stall stays on record
    single = measure(tiny_target, drafter, {"fixed": Fixed(None)}, [2], prompts, temperature=1.0,
                     max_new_tokens=16, seed=5, warmup=False)["fixed"][0]  # fmt: skip
    assert "repeats" not in single and (single["tau"], single["rounds"]) == (out["tau"], out["rounds"])


def test_measure_takes_the_repeats_in_turns_across_policies(tiny_target, monkeypatch):
    """With repeats, each policy's k-th timed run follows every policy's (k - 1)-th, so a drift of the
    device over a sweep lands on all policies alike, and the k-th turn starts at the k-th policy, so
    none always runs first or last; each policy is warmed once, before its first."""
    from dspark.scheduling.policies import Mtp1

    policies = {"fixed": Fixed(None), "mtp1": Mtp1(), "fixed_2": Fixed(2)}
    key = {id(pol): name for name, pol in policies.items()}
    order, inner = [], Engine.generate

    def generate(self, reqs, *args, **kw):
        warm = all(getattr(r, "max_new_tokens", None) == WARMUP_TOKENS for r in reqs)
        order.append(("warm " if warm else "") + key.get(id(self.policy), "first"))
        return inner(self, reqs, *args, **kw)

    monkeypatch.setattr(Engine, "generate", generate)
    prompts = prompts_for(tiny_target, 2, seed=4)
    out = measure(tiny_target, Oracle(tiny_target, gamma=3), policies, [2], prompts, temperature=1.0,
                  max_new_tokens=6, seed=5, repeats=3)  # fmt: skip
    # the first: the one tiny run before any point
    assert order[1:] == ["warm fixed", "fixed", "warm mtp1", "mtp1", "warm fixed_2", "fixed_2",
                         "mtp1", "fixed_2", "fixed", "fixed_2", "fixed", "mtp1"]  # fmt: skip
    assert [len(out[name][0]["repeats"]) for name in policies] == [3, 3, 3]


def test_measure_host_load_lengthens_the_host_cycle_and_changes_no_round(tiny_target):
    """The diagnostic host load (e2e --host-load-us): a busy wait before each round's completion,
    in the host's cycle but not in the round's own host work, the rounds themselves unchanged."""
    drafter = Oracle(tiny_target, gamma=3)
    prompts = prompts_for(tiny_target, 3, seed=2)
    points = {}
    for load in (0.0, 2e5):  # 200 ms: far above a round of the tiny target on a CPU
        out = measure(tiny_target, drafter, {"fixed": Fixed(None)}, [2], prompts, temperature=1.0,
                      max_new_tokens=12, seed=3, warmup=False, host_load_us=load)  # fmt: skip
        points[load] = out["fixed"][0]
    loaded, free = points[2e5], points[0.0]
    assert (loaded["tau"], loaded["rounds"]) == (free["tau"], free["rounds"])
    assert loaded["cycle_ms_per_round"] >= 200 > loaded["host_ms_per_round"]
    with pytest.raises(ValueError, match="host_load_us"):
        measure(tiny_target, drafter, {"fixed": Fixed(None)}, [2], prompts, host_load_us=-1)


def test_measure_waves_queue_requests_behind_the_slots(tiny_target, monkeypatch):
    """waves=3 at R = 2: six requests behind two slots (a request that ends hands its slot on), so
    the rounds run two rows until the queue runs dry; waves=1: the prompt repeated to fill the two."""
    sizes, inner = [], Engine.generate

    def generate(self, reqs, *args, **kw):
        if all(getattr(r, "max_new_tokens", None) is None for r in reqs):  # a timed run
            sizes.append(len(reqs))
        return inner(self, reqs, *args, **kw)

    monkeypatch.setattr(Engine, "generate", generate)
    prompts = prompts_for(tiny_target, 1, seed=2)
    drafter = Oracle(tiny_target, gamma=3)
    full = {}
    for waves in (3, 1):
        out = measure(tiny_target, drafter, {"fixed": Fixed(None)}, [2], prompts, temperature=1.0,
                      max_new_tokens=6, seed=3, warmup=False, waves=waves)["fixed"][0]  # fmt: skip
        full[waves] = sum(g["rounds"] for g in out["by_length"] if g["rows_bucket"] == 2)
    assert sizes == [6, 2] and full[3] > full[1] > 0
    with pytest.raises(ValueError, match="waves"):
        measure(tiny_target, drafter, {"fixed": Fixed(None)}, [2], prompts, waves=0)


def test_points_keep_the_rounds_by_length_and_the_acceptance():
    """A point's digest of its rounds: per rows bucket and drafted length the rounds, their mean
    time, tokens per live row and the table's price of them; the acceptance per draft position the
    rows realised (reached and accepted, counted like the schedulers' estimate); and the estimate of a
    policy that keeps one, over the longest draft verified; and a walking policy's reasons to walk."""
    from types import SimpleNamespace

    from dspark.bench.measure import (
        _by_length,
        _estimate,
        _plans,
        _realised_acceptance,
        _walk_state,
    )
    from dspark.scheduling.policies import DraftAware, HardwareAware, Truncated

    steps = [
        {"ms": 2.0, "host_ms": 1.0, "batch": 3, "drafted": 2, "tokens": 6, "verified": 9},
        # a walk cut it (it read its width back)
        {"ms": 4.0, "host_ms": 2.0, "batch": 3, "drafted": 2, "tokens": 3, "verified": 6, "readback_ms": 0.2},
        {"ms": 1.0, "host_ms": 0.5, "batch": 1, "drafted": 0, "tokens": 1, "verified": 1},
        {"ms": None, "batch": 1, "drafted": 0, "tokens": 1, "verified": 1},  # no clock: left out
    ]
    cost = CostModel({1: 1.0, 16: 4.0}, draft_ms={1: 0.5, 16: 1.0})
    by = _by_length(steps, cost)
    assert [(g["rows_bucket"], g["drafted"], g["rounds"]) for g in by] == [(4, 2, 2), (1, 0, 1)]
    assert [by[0][k] for k in ("ms", "host_ms", "tokens_per_row", "verified_per_row")] == [3.0, 1.5, 1.5, 2.5]
    assert by[1]["tokens_per_row"] == by[1]["verified_per_row"] == 1.0
    assert [g["walked"] for g in by] == [1, 0]  # the round that read its width back
    assert by[0]["priced_ms"] == pytest.approx(1e3 * cost.round_time(3, 2))
    assert by[1]["priced_ms"] == pytest.approx(1.0) and _by_length(steps, None)[0]["priced_ms"] is None
    # by what the round before was: a drafting round after a drafting one with the same rows, a plain
    # round after a drafting one whose rows changed (the first round has none before it; no clock:
    # out)
    moves = [
        (g["rows_bucket"], g["drafted"], g["after"], g["rows"], g["rounds"], g["ms"])
        for g in rounds_by_transition(steps)
    ]
    assert moves == [(4, 2, "drafting", "same", 1, 4.0), (1, 0, "drafting", "changed", 1, 1.0)]
    # rows verified (ℓ) and accepted (n): position 1 reached by three rows, accepted by two;
    # position 2 reached by the one that accepted position 1 with ℓ = 2, and accepted
    rounds = [SimpleNamespace(proposed=ell, accepted=n) for ell, n in [(2, 2), (2, 0), (1, 1), (0, 0)]]
    assert _realised_acceptance(rounds) == pytest.approx([2 / 3, 1.0])
    assert _realised_acceptance([SimpleNamespace(proposed=0, accepted=0)]) == []
    aware = DraftAware()
    aware.observe_round(np.array([2, 2, 1, 0]), np.array([2, 0, 1, 0]))
    assert _estimate(aware, rounds) == pytest.approx([(2 + 1) / (3 + 1), (1 + 1) / (1 + 1)])
    assert _estimate(Truncated(aware, 2), rounds) == _estimate(aware, rounds)
    assert _estimate(Fixed(None), rounds) is None and _estimate(None, rounds) is None
    hw = HardwareAware(explore_every=2)  # the first round walks, the second explores a whole draft
    assert _walk_state(hw) == {"realised": None, "clock": []}
    for walked, ms in [(True, 2.0), (False, 4.0)]:  # 3 rows, each accepting both drafts: 9 tokens
        assert hw.width(hw.draft_length(3, 2, cost)) == (None if walked else 2)
        hw.observe_round(np.array([2, 2, 2]), np.array([2, 2, 2]))
        hw.observe_time(ms)
    state = _walk_state(Truncated(hw, 2))
    assert state["realised"] == 0.0  # the walk kept every draft whole: it saved nothing
    clock = [(c["rows_bucket"], c["walked"], c["rounds"]) for c in state["clock"]]
    assert clock == [(4, False, 1), (4, True, 1)]
    assert [c["tokens_per_ms"] for c in state["clock"]] == pytest.approx([9 / 4.0, 9 / 2.0])
    assert _walk_state(aware) is None and _walk_state(None) is None
    # what decided each round's length: rates over plain's, and why the plain rounds were plain
    # (rates in tokens/s, clock ratios, expected tokens, per drafted length)
    planned = [
        {"step": 0, "ms": 2.0, "batch": 3, "drafted": 2, "tokens": 5,
         "plan": ([100.0, 90.0, 120.0], [1.0, 1.0, 1.1], [3.0, 4.8, 6.0])},
        {"step": 1, "ms": 1.0, "batch": 3, "drafted": 0, "tokens": 3,
         "plan": ([100.0, 103.0, 101.0], [1.0, 1.0, 1.0], [3.0, 4.8, 6.0])},
        {"step": 2, "ms": 1.0, "batch": 2, "drafted": 0, "tokens": 2,
         "plan": ([100.0, 90.0, 80.0], [1.02, 1.0, 1.0], [2.0, 3.2, 4.0])},
    ]  # fmt: skip
    p = _plans(planned)
    assert p["over_plain"][0] == [1.0, 0.9, 1.2] and p["clock_ratio"][2] == [1.02, 1.0, 1.0]
    # what each round emitted, and what its plan expected of the length it chose: tokens, and ms
    assert p["tokens"] == [5, 3, 2] and p["expected_tokens"] == [6.0, 3.0, 2.0]
    assert p["expected_ms"] == [50.0, 30.0, 20.0]  # 1e3 · tokens / rate
    assert (p["drafted"], p["rows"], p["walked"]) == ([2, 0, 0], [3, 3, 2], [0, 0, 0])
    assert (p["plain_rounds"], p["plain_declined_faster"], p["drafting_rounds"]) == (2, 1, 1)
    assert p["plain_best_draft_max"] == pytest.approx(1.03) and p["drafting_chosen_median"] == 1.2
    probed = _plans(planned[:1] + [{**planned[2], "drafted": 1}])  # a draft ranked below plain: a probe
    assert p["drafting_below_plain"] == 0 and probed["drafting_below_plain"] == 1
    assert _plans(steps) is None  # no policy weighed lengths


def test_decode_kernels_bench_times_the_references_off_cuda(tmp_path):
    """The decoding kernels' benchmark on the CPU: the replaced steps timed (the compiled Markov
    position's ops, the sort-based top-p, the softmax, the LM head over 7 and 8 positions), no
    kernel (CUDA only), a row per size, its JSON with provenance."""
    from dspark.bench import decode_kernels

    out = tmp_path / "dk.json"
    sizes = ["--rows", "1,3", "--topp-rows", "4", "--vocab", "512", "--rank", "16"]
    decode_kernels.main([*sizes, "--repeats", "2", "--warmup", "1", "--device", "cpu", "--out", str(out)])
    report = json.loads(out.read_text())
    assert {"command", "commit", "date"} <= report.keys() and report["machine"]["device"] == "cpu"
    assert report["vocab"] == 512
    assert [r["rows"] for r in report["greedy_position"]] == [1, 3]
    assert [r["rows"] for r in report["top_p_filter"]] == [4]
    assert [(r["rows"], r["positions"]) for r in report["lm_head"]] == [(1, 7), (1, 8), (3, 7), (3, 8)]
    assert report["lm_head_floor_ms"] == pytest.approx(1e3 * 512 * 576 * 4 / 4.8e12)  # float32 off CUDA
    rows = report["greedy_position"] + report["top_p_filter"] + report["lm_head"]
    assert all("kernel_ms" not in r for r in rows)
    assert all(r[k] > 0 for r in rows for k in r if k.endswith("_ms"))


def test_round_profile_ranks_the_host_work_of_real_rounds(tiny_target, tmp_path):
    from dspark.bench import round_profile

    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "markov")
    out = tmp_path / "rp.json"
    report = round_profile.main(
        ["--drafter-dir", str(drafter), "--benchmark-dir", str(_bench(tmp_path / "bench")), "--prompts", "2",
         "--concurrency", "2", "--temperature", "0,1", "--max-new-tokens", "6", "--top", "400",
         "--out", str(out), "target=tiny"]
    )  # fmt: skip
    assert json.loads(out.read_text())["points"] == report["points"]
    assert [(p["temperature"], p["concurrency"]) for p in report["points"]] == [(0.0, 2), (1.0, 2)]
    for p in report["points"]:
        assert p["rounds"] > 0 and p["host_ms_per_round"] > 0 and p["profiled_ms_per_round"] > 0
        own = [r["own_us"] for r in p["top"]]
        assert own == sorted(own, reverse=True)
        launch = next(r for r in p["top"] if r["function"].endswith("(_launch)"))
        assert launch["calls"] == 1.0 and launch["cumulative_us"] > launch["own_us"]  # one launch a round
        assert not any(r["function"].endswith("(_prefill)") for r in p["top"])  # rounds only
    assert any("drafters/" in r["function"] for r in report["points"][0]["top"])  # the draft step ran
    sampled = {r["function"] for r in report["points"][1]["top"]}
    assert any(f.endswith("(rejection_verify_reference)") for f in sampled)  # T = 1 verifies by sampling
    alone = round_profile.main(
        ["--drafter-dir", str(drafter), "--benchmark-dir", str(tmp_path / "bench"), "--prompts", "2",
         "--concurrency", "2", "--temperature", "1", "--max-new-tokens", "6", "--top", "400",
         "--policy", "target_only", "--out", str(tmp_path / "alone.json"), "target=tiny"]
    )  # fmt: skip
    assert not any("drafters/" in r["function"] for r in alone["points"][0]["top"])  # no drafter ran


def test_layer_compile_bench_compares_a_shape_compile_with_the_eager_layer(tmp_path):
    """The layer-compile benchmark on the CPU at a tiny layer: the eager layer functions and the
    ones compiled for each step's shape, timed per step, the shape-compiled outputs and K/V stores
    checked against the eager ones; bad steps are refused before anything runs."""
    from dspark.bench import layer_compile

    out = tmp_path / "lc.json"
    tiny = ["--hidden", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--intermediate", "48"]
    argv = [*tiny, "--steps", "2x1,2x3", "--context", "8", "--variants", "eager,static", "--repeats", "2"]
    report = layer_compile.main([*argv, "--warmup", "1", "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text())["steps"] == report["steps"]
    assert report["variants"] == ["eager", "static"] and report["layer"]["kv_heads"] == 2
    assert [(s["rows"], s["width"]) for s in report["steps"]] == [(2, 1), (2, 3)]
    assert all(s["static_agrees"] and s["eager_ms"] > 0 and s["static_ms"] > 0 for s in report["steps"])
    for bad in (["--steps", "2x9"], ["--steps", "2by3"], ["--variants", "static"]):
        with pytest.raises(SystemExit):
            layer_compile.main([*tiny, "--context", "8", *bad, "--device", "cpu", "--out", str(out)])
