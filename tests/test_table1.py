"""Table 1 and the paper's figures from real evaluation folders: `python -m dspark.evaluate` run on
the tiny target (near-uniform, so a random drafter gets accepted tokens at T = 1 and τ varies across
prompts) for DFlash and DSpark-Markov at T = 0 and T = 1, then gathered by `python -m dspark.report
mode=table1 | figures`, the bad inputs that must not make a table, and scripts/h200_table1.sh in its
dry-run mode (its spec splitting, skipping, budget and the gathering it runs on the CPU)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import BENCHMARKS, ROOT, load_group
from hydra import compose, initialize_config_module
from test_evaluate import _save

from dspark.core.errors import DataError
from dspark.decoding.uncertainty import paired_comparison, ratio_stderr
from dspark.reporting.labelled import read_labelled
from dspark.reporting.table1 import build_tables, findings, table_markdown

# Near-uniform next-token distributions: a random drafter is accepted often at T = 1.
FLAT = ["target=tiny", "target.tiny.initializer_range=0.02"]
BENCH = ["gsm8k", "humaneval", "mt-bench"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _evaluate(drafter: Path, out: Path, temperature: float, *more: str) -> Path:
    from dspark import evaluate

    with initialize_config_module("dspark.conf", version_base="1.3"):
        cfg = compose(
            "evaluate",
            overrides=[
                *FLAT,
                f"drafter_dir={drafter}",
                f"out_dir={out}",
                f"benchmarks=[{','.join(BENCH)}]",
                f"benchmark_dir={BENCHMARKS}",
                "max_prompts=4",
                "max_new_tokens=16",
                "concurrency=4",
                "progress=false",
                f"temperature={temperature}",
                *more,
            ],
        )
    evaluate.run(cfg)
    return out


@pytest.fixture(scope="module")
def flat_target():
    from dspark.target import load_target

    cfg = load_group("target", "tiny")
    cfg.tiny.initializer_range = 0.02
    return load_target(cfg)


@pytest.fixture(scope="module")
def evals(flat_target, tmp_path_factory) -> dict[str, Path]:
    """Evaluation folders keyed "<drafter>_t<T>"; DSpark calibrated on held-out prompts (Fig. 6)."""
    base = tmp_path_factory.mktemp("table1")
    cal = base / "calibration.jsonl"
    cal.write_text(
        "".join(json.dumps({"turns": [q]}) + "\n" for q in ["Say hello.", "Count to five.", "Why?"])
    )
    drafters = {
        "dflash": _save(flat_target, base / "drafters" / "dflash", "dflash"),
        "dspark": _save(flat_target, base / "drafters" / "dspark", "dspark", "markov"),
        "dflash3": _save(flat_target, base / "drafters" / "dflash3", "dflash", gamma=3),
    }
    out = {}
    for name, t in [("dflash", 0), ("dflash", 1), ("dspark", 0), ("dspark", 1), ("dflash3", 1)]:
        more = ["calibrate=true", f"calibration.file={cal}"] if name == "dspark" else []
        out[f"{name}_t{t}"] = _evaluate(drafters[name], base / "evals" / f"eval_{name}_t{t}", t, *more)
    out["drafters"] = base / "drafters"
    return out


def _report(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dspark.report", *args, f"hydra.run.dir={tmp_path / 'report'}"]
    return subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_results_carry_tau_standard_errors_over_requests(evals):
    """results.json's τ and its error agree with the per-request counts of generations.jsonl
    (accepted tokens and rounds of each prompt), an independent record of the same rollouts."""
    res = json.loads((evals["dspark_t1"] / "results.json").read_text())
    assert res["gamma"] == 4 and res["temperature"] == 1.0
    gens = _lines(evals["dspark_t1"] / "generations.jsonl")
    errors = []
    for name in BENCH:
        mine = [g for g in gens if g["benchmark"] == name]
        tokens = [g["accepted"] + g["rounds"] for g in mine]  # Σ (accepted + 1) over its rounds
        rounds = [g["rounds"] for g in mine]
        b = res["benchmarks"][name]
        assert b["requests"] == len(mine) == 4 and b["rounds"] == sum(rounds)
        assert b["tau"] == pytest.approx(sum(tokens) / sum(rounds))
        assert b["tau_stderr"] == pytest.approx(ratio_stderr(tokens, rounds))
        errors.append(b["tau_stderr"])
    assert any(e > 0 for e in errors)  # τ does vary across these prompts
    assert res["macro_stderr"]["all"] == pytest.approx(math.sqrt(sum(e * e for e in errors)) / 3)
    assert res["macro_stderr"]["math"] == pytest.approx(errors[0])  # one math benchmark here
    assert "±" in (evals["dspark_t1"] / "table.md").read_text()


def test_table1_cli_gathers_rows_per_temperature(evals, tmp_path):
    rows = [("DFlash", "dflash_t0"), ("DSpark-Markov", "dspark_t0"), ("DFlash", "dflash_t1")]
    rows.append(("DSpark-Markov", "dspark_t1"))
    runs = ",".join(f"{label}:{evals[key]}" for label, key in rows)
    out = tmp_path / "published" / "table1.json"
    proc = _report(tmp_path, "mode=table1", f"runs=[{runs}]", f"table1={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = json.loads(out.read_text())
    assert [t["temperature"] for t in tables] == [0.0, 1.0]
    for table, t in zip(tables, (0, 1)):
        assert table["target"] == "tiny" and table["gamma"] == 4
        assert list(table["rows"]) == ["DFlash", "DSpark-Markov"]  # in the order given
        for label, key in (("DFlash", f"dflash_t{t}"), ("DSpark-Markov", f"dspark_t{t}")):
            res = json.loads((evals[key] / "results.json").read_text())
            row, err = table["rows"][label], table["stderr"][label]
            assert set(row) == {*BENCH, "macro"} and row["macro"] == res["macro"]
            assert err["macro"] == res["macro_stderr"]
            for name in BENCH:
                assert row[name] == res["benchmarks"][name]["tau"]
                assert err[name] == res["benchmarks"][name]["tau_stderr"]
                assert table["prompts"][label][name] == 4
            assert table["sources"][label] == str(evals[key])
    md = out.with_suffix(".md").read_text()
    assert md.strip() in proc.stdout  # printed as well
    assert "**T = 0, γ = 4**" in md and "**T = 1, γ = 4**" in md and "prompts per benchmark: gsm8k 4" in md
    dspark = tables[1]["rows"]["DSpark-Markov"]
    assert f"{dspark['gsm8k']:.2f} ± {tables[1]['stderr']['DSpark-Markov']['gsm8k']:.2f}" in md
    assert "Macro math" in md and "Macro code" in md and "Macro chat" in md and "Macro all" in md
    for table in tables:  # the paper's claim, DSpark ≥ 1.10 × DFlash, checked on these rows
        (claim,) = table["findings"]
        ds, df = (table["rows"][k]["macro"]["all"] for k in ("DSpark-Markov", "DFlash"))
        assert (claim["row"], claim["baseline"], claim["goal"]) == ("DSpark-Markov", "DFlash", 1.10)
        assert claim["ratio"] == pytest.approx(ds / df) and claim["met"] == (ds / df >= 1.10)
        assert claim["stderr_kind"] == "paired"  # both rows carry each prompt's totals
        assert f"- DSpark-Markov / DFlash: {claim['ratio']:.3f} ± {claim['stderr']:.3f} (paired)" in md
        (diff,) = table["differences"]
        assert (diff["row"], diff["baseline"], diff["stderr_kind"]) == ("DSpark-Markov", "DFlash", "paired")
        assert f"- DSpark-Markov − DFlash: {diff['difference']:+.3f} ± {diff['stderr']:.3f} (paired)" in md


def test_findings_hold_each_dspark_row_against_each_baseline():
    def row(tau, se):
        return {"macro": {"all": tau}}, {"macro": {"all": se}}

    table = {"rows": {}, "stderr": {}}
    for label, tau, se in [("E", 4.0, 0.04), ("D", 2.0, 0.02), ("M", 2.4, 0.0), ("G", 3.0, None)]:
        table["rows"][label], table["stderr"][label] = row(tau, se)
    kinds = {"E": "eagle3", "D": "dflash", "M": "dspark-markov", "G": "dspark-gated"}
    got = {(f["row"], f["baseline"]): f for f in findings(table, kinds)}
    assert set(got) == {("M", "E"), ("M", "D"), ("G", "E"), ("G", "D")}  # no baseline against a baseline
    md, me = got["M", "D"], got["M", "E"]
    assert md["ratio"] == pytest.approx(1.2) and md["met"] and md["goal"] == 1.10
    assert me["ratio"] == pytest.approx(0.6) and not me["met"] and me["goal"] == 1.25
    assert got["M", "D"]["stderr"] == pytest.approx(1.2 * 0.01)  # delta method: (0/2.4, 0.02/2)
    assert got["G", "D"]["stderr"] is None  # an error not recorded stays unknown


def test_one_table_is_one_object_and_labels_default_to_the_drafter(evals, tmp_path):
    proc = _report(tmp_path, "mode=table1", f"runs=[{evals['dflash_t1']},{evals['dspark_t1']}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads((tmp_path / "report" / "table1.json").read_text())
    assert isinstance(table, dict) and list(table["rows"]) == ["dflash", "dspark-markov"]


def _copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    res = json.loads((dst / "results.json").read_text())
    (dst / "results.json").write_text(json.dumps({**res, **changes}))
    return dst


def test_rows_that_do_not_compare_are_refused(evals, tmp_path):
    def tables(*sources, split_gamma=False):
        return build_tables(read_labelled([str(s) for s in sources]), split_gamma)

    with pytest.raises(DataError, match=r"γ differs between the rows at T=1: .*dflash γ=4.*split_gamma=true"):
        tables(evals["dflash_t1"], f"b3:{evals['dflash3_t1']}")
    by_gamma = tables(evals["dflash_t1"], f"b3:{evals['dflash3_t1']}", split_gamma=True)
    assert [(t["temperature"], t["gamma"], list(t["rows"])) for t in by_gamma] == [
        (1.0, 3, ["b3"]),
        (1.0, 4, ["dflash"]),
    ]
    other = _copy(evals["dspark_t1"], tmp_path / "other", target="qwen3_4b")
    with pytest.raises(DataError, match="different targets .*tiny: .*qwen3_4b: .*gather each target"):
        tables(evals["dflash_t1"], other)
    threshold = _copy(evals["dspark_t1"], tmp_path / "thr", policy={"name": "threshold", "threshold": 0.5})
    with pytest.raises(DataError, match="policy=threshold: Table 1 verifies fixed blocks"):
        tables(threshold)
    with pytest.raises(DataError, match="two evaluations at T=1 are labelled X .*name each row"):
        tables(f"X:{evals['dflash_t1']}", f"X:{evals['dspark_t1']}")
    fewer = _copy(evals["dspark_t1"], tmp_path / "fewer")
    res = json.loads((fewer / "results.json").read_text())
    del res["benchmarks"]["humaneval"]
    (fewer / "results.json").write_text(json.dumps(res))
    with pytest.raises(DataError, match="evaluate every row on the same benchmarks"):
        tables(evals["dflash_t1"], fewer)
    with pytest.raises(DataError, match="no evaluation folder .*missing: pass the out_dir"):
        tables(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty has no results.json: not a finished evaluation"):
        tables(tmp_path / "empty")
    with pytest.raises(DataError, match="labels a glob"):
        tables(f"A:{tmp_path}/*")
    # On the command line: one line, exit 2.
    proc = _report(tmp_path, "mode=table1", f"runs=[{evals['dflash_t1']},b3:{evals['dflash3_t1']}]")
    assert proc.returncode == 2 and proc.stderr.startswith("dspark: error: γ differs between the rows")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_folders_written_before_the_errors_still_gather(evals, tmp_path):
    """An evaluation from before results.json carried γ and the errors (the published ones): γ from
    the position-wise acceptance, errors null, the table without ±."""
    old = tmp_path / "old"
    shutil.copytree(evals["dflash_t1"], old)
    res = json.loads((old / "results.json").read_text())
    for key in ("gamma", "macro_stderr"):
        del res[key]
    res["policy"]["gamma"] = None
    for b in res["benchmarks"].values():
        del b["tau_stderr"], b["requests"], b["request_totals"]
    (old / "results.json").write_text(json.dumps(res))
    (table,) = build_tables(read_labelled([f"Old:{old}"]))
    assert table["gamma"] == 4 and table["stderr"]["Old"]["gsm8k"] is None
    md = table_markdown(table)
    assert "±" not in md and "prompts per benchmark: not recorded" in md


def test_rows_on_the_same_prompts_are_compared_paired(evals, tmp_path):
    """Two rows evaluated on the same prompts: their comparison's errors are the paired ones, from each
    prompt's totals, which agree with generations.jsonl (an independent record of the same rollouts);
    a row without the totals (an older folder) or on other prompts falls back to independent errors."""

    def totals(folder: Path) -> dict:
        out = {}
        for g in _lines(folder / "generations.jsonl"):
            out.setdefault(g["benchmark"], {})[g["id"]] = (g["accepted"] + g["rounds"], g["rounds"])
        return out

    # The fixture's DSpark-Markov starts with a zero bias, so it drafts as its DFlash does: sample
    # DFlash's rounds with another seed for two rows that differ on the same prompts.
    dflash = _evaluate(evals["drafters"] / "dflash", tmp_path / "dflash_seed1", 1, "seed=1")
    (table,) = build_tables(read_labelled([str(dflash), str(evals["dspark_t1"])]))
    want = paired_comparison(totals(evals["dspark_t1"]), totals(dflash))
    (claim,) = table["findings"]
    (diff,) = table["differences"]
    assert claim["stderr_kind"] == diff["stderr_kind"] == "paired"
    assert claim["ratio"] == pytest.approx(want["ratio"]) and claim["stderr"] == pytest.approx(
        want["ratio_stderr"]
    )
    assert diff["difference"] == pytest.approx(want["difference"])
    assert diff["stderr"] == pytest.approx(want["difference_stderr"]) and diff["stderr"] > 0
    assert diff["z"] == pytest.approx(diff["difference"] / diff["stderr"])
    # Position by position, from the same prompts: Fig. 2's curves (the mean over the benchmarks) of the
    # two rows apart, paired, as rounds.jsonl's rounds count them
    (pos,) = table["position_differences"]
    assert (pos["row"], pos["baseline"]) == (diff["row"], diff["baseline"])
    rows = {f: _positions(f, 4) for f in (evals["dspark_t1"], dflash)}
    for k in range(4):
        want = paired_comparison(*(at(k) for at in (rows[evals["dspark_t1"]], rows[dflash])))
        assert pos["difference"][k] == pytest.approx(want["difference"])
        assert pos["stderr"][k] == pytest.approx(want["difference_stderr"])
    curves = {f: json.loads((f / "results.json").read_text())["benchmarks"] for f in rows}
    mean = {f: sum(b["accept_rate_by_position"][0] for b in c.values()) / len(c) for f, c in curves.items()}
    assert pos["difference"][0] == pytest.approx(mean[evals["dspark_t1"]] - mean[dflash])
    assert "Differences by draft position" in table_markdown(table)

    def independent(folder: Path) -> None:
        (table,) = build_tables(read_labelled([str(dflash), str(folder)]))
        (diff,) = table["differences"]
        se = [table["stderr"][label]["macro"]["all"] for label in table["rows"]]
        assert diff["stderr_kind"] == "independent" and diff["stderr"] == pytest.approx(math.hypot(*se))
        assert table["findings"][0]["stderr_kind"] == "independent"

    old = tmp_path / "old"
    shutil.copytree(evals["dspark_t1"], old)
    res = json.loads((old / "results.json").read_text())
    for b in res["benchmarks"].values():
        del b["request_totals"]
    (old / "results.json").write_text(json.dumps(res))
    independent(old)
    other = tmp_path / "other"  # the same benchmarks, one prompt missing from gsm8k
    shutil.copytree(evals["dspark_t1"], other)
    res = json.loads((other / "results.json").read_text())
    res["benchmarks"]["gsm8k"]["request_totals"].pop("gsm8k/3")
    (other / "results.json").write_text(json.dumps(res))
    independent(other)


def _positions(folder: Path, gamma: int):
    """k -> benchmark -> request -> (rounds that accepted k, rounds that reached it), from rounds.jsonl."""
    counts: dict = {}
    for r in _lines(folder / "rounds.jsonl"):
        per = counts.setdefault(r["benchmark"], {}).setdefault(r["request"], [[0] * gamma, [0] * gamma])
        for k in range(min(r["accepted"] + 1, r["proposed"], gamma)):
            per[1][k] += 1
            per[0][k] += r["accepted"] > k

    def at(k: int) -> dict:
        return {n: {q: (c[0][k], c[1][k]) for q, c in per.items()} for n, per in counts.items()}

    return at


def test_figures_cli_draws_figs_2_5_6_with_their_json(evals, tmp_path):
    labels = {"dflash": "DFlash", "dspark": "DSpark"}
    runs = "runs=[" + ",".join(f"{labels[d]}:{evals[f'{d}_t{t}']}" for t in (0, 1) for d in labels) + "]"
    proc = _report(tmp_path, "mode=figures", runs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "report"
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == [
        "fig2_acceptance_T0.png",
        "fig2_acceptance_T1.png",
        "fig5_threshold_DSpark_T0.png",
        "fig5_threshold_DSpark_T1.png",
        "fig6_reliability_DSpark_T0.png",
        "fig6_reliability_DSpark_T1.png",
    ]
    for png in pngs:
        assert (out / png).stat().st_size > 5000 and (out / png).with_suffix(".json").is_file()
    fig2 = json.loads((out / "fig2_acceptance_T1.json").read_text())
    assert set(fig2["domains"]) == {"math", "code", "chat"} and set(fig2["domains"]["math"]) == {
        "DFlash",
        "DSpark",
    }
    res = json.loads((evals["dspark_t1"] / "results.json").read_text())
    # One benchmark per domain here, so the domain's curve is that benchmark's.
    assert fig2["domains"]["code"]["DSpark"] == res["benchmarks"]["humaneval"]["accept_rate_by_position"]
    fig5 = json.loads((out / "fig5_threshold_DSpark_T1.json").read_text())
    assert fig5["label"] == "DSpark" and fig5["temperature"] == 1.0 and fig5["sweep"]
    fig6 = json.loads((out / "fig6_reliability_DSpark_T1.json").read_text())
    assert [p["position"] for p in fig6["positions"]] == [1, 2, 3, 4]
    md = (out / "figures.md").read_text()
    assert "| DSpark | 1 |" in md and "AUROC (mean)" in md and md in proc.stdout


def test_figures_of_a_batch_without_confidence_heads_say_why(evals, tmp_path):
    proc = _report(tmp_path, "mode=figures", f"runs=[{evals['dflash_t1']}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "report" / "figures.md").read_text()
    assert "no Fig. 5: no drafter here has a confidence head" in md and "no Fig. 6" in md


# ----------------------------------------------------------------------------------------------
# scripts/h200_table1.sh, dry run: the device steps printed, the rest real

SCRIPT = ROOT / "scripts" / "h200_table1.sh"


def test_scripts_parse():
    for name in ("h200_table1.sh", "h200_drafter.sh", "h200_session.sh"):
        proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def _dry(cwd: Path, *args: str, **env) -> subprocess.CompletedProcess:
    env = {**ENV, "DRY_RUN": "1", "PYTHON": sys.executable, "OUT": str(cwd / "out"), **env}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_script_refuses_bad_arguments(tmp_path):
    proc = _dry(tmp_path, "three", "DFlash:drafter=dflash")
    assert proc.returncode == 2 and "usage: bash scripts/h200_table1.sh MINUTES" in proc.stderr
    proc = _dry(tmp_path, "3")
    assert proc.returncode == 2 and "usage" in proc.stderr
    proc = _dry(tmp_path, "3", "DFlash:drafter=dflash trainer.max_time=00:00:09:00")
    assert (
        proc.returncode == 2
        and "sets trainer.max_time: the batch sets it for every drafter alike" in proc.stdout
    )


def test_script_plans_a_fresh_batch(tmp_path):
    proc = _dry(tmp_path, "3", "Eagle3:drafter=eagle3", "DSpark-Markov:drafter=dspark head=markov")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert len(steps) == 6  # per drafter: train, eval T = 0, eval T = 1
    assert steps[0].endswith("h200_drafter.sh train Eagle3 3 drafter=eagle3")
    # 560 s a call, 40 s kept for gathering, 30 for the save, less the seconds the dry run took to
    # get there (a loaded CI machine once took one: 489)
    limit = int(steps[0].split("CALL_LIMIT=")[1].split()[0])
    assert 480 <= limit <= 490
    assert "EVAL_T=0 " in steps[1] and "EVAL_T=1 " in steps[2] and "eval Eagle3" in steps[2]
    assert steps[3].endswith("train DSpark-Markov 3 drafter=dspark head=markov")
    assert "batch complete" in proc.stdout
    # A call without the time to start a training slice starts none and says what comes next.
    proc = _dry(tmp_path, "3", "Eagle3:drafter=eagle3", CALL_LIMIT="150")
    assert "+ " not in proc.stdout and "call again with the same arguments; next: train Eagle3" in proc.stdout


def test_script_resumes_a_batch_and_gathers_it(evals, tmp_path):
    """Two drafters trained, DFlash evaluated at both temperatures, DSpark at T = 0 only: the next
    call trains nothing, evaluates DSpark at T = 1 with what its drafter needs (the fast engine, STS
    on the held-out prompts), and gathers Table 1 and the figures of what is there into $OUT."""
    h200 = tmp_path / "outputs" / "h200"
    for name, src in (("DFlash", "dflash"), ("DSpark", "dspark")):
        shutil.copytree(evals["drafters"] / src, h200 / name / "drafter")
        (h200 / name / "summary.json").write_text("{}")
    for key, name in (("dflash_t0", "DFlash_t0"), ("dflash_t1", "DFlash_t1"), ("dspark_t0", "DSpark_t0")):
        shutil.copytree(evals[key], h200 / f"eval_{name}")
    proc = _dry(tmp_path, "3", "DFlash:drafter=dflash", "DSpark:drafter=dspark head=markov")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert len(steps) == 1 and "EVAL_T=1 " in steps[0]
    assert steps[0].endswith(
        "eval DSpark engine=fast calibrate=true calibration.file=outputs/h200/batch/calibration_prompts.jsonl"
    )
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "batch.tar.xz",
        "figures.md",
        "log.txt",
        "table1.json",
        "table1.md",
    ]
    t0, t1 = json.loads((out / "table1.json").read_text())
    assert list(t0["rows"]) == ["DFlash", "DSpark"] and list(t1["rows"]) == ["DFlash"]
    assert t0["sources"]["DSpark"] == "outputs/h200/eval_DSpark_t0"
    with tarfile.open(out / "batch.tar.xz") as tar:
        names = set(tar.getnames())
    for member in (
        "./evals/DSpark_t0/results.json",
        "./evals/DSpark_t0/reliability.json",
        "./report/table1.json",
        "./report/fig2_acceptance_T0.json",
        "./report/fig6_reliability_DSpark_T0.png",
        "./steps.tsv",
    ):
        assert member in names, member
    assert not any(n.endswith(("rounds.jsonl", "generations.jsonl")) for n in names)


# ----------------------------------------------------------------------------------------------
# scripts/h200_session.sh, batch stage: the device steps stubbed, its orchestration and gathering real

STUB = """#!/usr/bin/env bash
# h200_drafter.sh's train / sweep / eval as the session's batch stage calls them: copies of real
# folders, each step's start and end times logged. A run named DFlash trains for 1 s, any other until
# DFlash's evaluation has started (60 s at most: a session that evaluates nothing before the batch
# ends shows it in the times), then 1 s more: the short run's evaluations (their arguments read by
# Python first, seconds on a loaded machine) start while the long one trains.
set -e
stamp() { echo "$1 $2 $(date +%s.%N)" >> outputs/h200/stub_times.txt; }
until_evaluated() {  # until_evaluated NAME: wait for its first evaluation to start (60 s at most)
  for _ in $(seq 300); do grep -q "^eval $1 " outputs/h200/stub_times.txt && break; sleep 0.2; done
  sleep 1
}
trained() {  # trained NAME DRAFTER [LAYERS]: a finished run's folder, summary last (as training writes it)
  mkdir -p outputs/h200/$1
  cp -r "$SRC/drafters/$2" outputs/h200/$1/drafter
  printf 'run_name: %s\ndrafter: {num_layers: %s}\n' $1 ${3:-5} > outputs/h200/$1/config.yaml
  echo '{"global_step": 2}' > outputs/h200/$1/summary.json
}
case $1 in
train)
  stamp start $2
  if [ "$2" = DFlash ]; then sleep 1; else until_evaluated DFlash; fi
  trained $2 ${2,,}
  stamp end $2 ;;
sweep)  # a two-point grid 'DSpark-${…}' in one process: its second run ends once the first is evaluated
  stamp start sweep
  trained DSpark-A dspark 1
  stamp end DSpark-A
  until_evaluated DSpark-A
  trained DSpark-B dspark 2
  stamp end DSpark-B ;;
eval)
  stamp eval $2
  stamp "t$EVAL_T" $2
  echo "$2 T=$EVAL_T ${*:3}" >> outputs/h200/stub_evals.txt
  src=${2,,}
  out=outputs/h200/eval_$2_t$EVAL_T
  cp -r "$SRC/evals/eval_${src%%-*}_t$EVAL_T" $out
  # as evaluate writes it: the drafter it read, the run's
  sed -i 's#"drafter_dir": *"[^"]*"#"drafter_dir": "outputs/h200/'"$2"'/drafter"#' $out/meta.json
  sleep 1
  stamp "t${EVAL_T}_end" $2 ;;
esac
"""


def _session_batch(evals, tmp_path: Path, **settings) -> tuple[Path, dict]:
    """`h200_session.sh start` with STAGES=batch and the stubbed device steps, waited on; the
    outputs folder and the steps' logged times."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "h200_session.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "h200_drafter.sh").write_text(STUB)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    cal = tmp_path / "cal.jsonl"
    cal.write_text(json.dumps({"turns": ["Say hello."]}) + "\n")
    env = {**ENV, "PATH": f"{bin_dir}{os.pathsep}{ENV['PATH']}", "SRC": str(evals["drafters"].parent),
           "PYTHONPATH": str(ROOT / "src"), "STAGES": "batch", "TRAIN_MINUTES": "3", "CAL_FILE": str(cal),
           "OUT": str(tmp_path / "out"), **settings}  # fmt: skip

    def run(*args):
        cmd = ["bash", "scripts/h200_session.sh", *args]
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    assert run("start").returncode == 0
    proc = run("wait", "240")
    assert "PIPELINE DONE" in proc.stdout, proc.stdout + proc.stderr
    h200 = tmp_path / "outputs" / "h200"
    times: dict = {}
    for line in (h200 / "stub_times.txt").read_text().split("\n")[:-1]:
        what, name, t = line.split()
        times.setdefault((what, name), float(t))  # an evaluation's first start
    return h200, times


def test_session_batch_stage_trains_at_once_and_gathers(evals, tmp_path):
    """`h200_session.sh start` with STAGES=batch runs the drafters' trainings at the same time,
    evaluates each at T = 0 and 1 with the overrides its drafter needs as soon as its own training
    ends (the short run's evaluations beside the long run's training), gathers Table 1, the figures
    and the dashboard, and `wait` brings back a bundle without rounds or generations."""
    h200, times = _session_batch(
        evals, tmp_path, RUNS="DFlash:drafter=dflash;DSpark:drafter=dspark head=markov"
    )
    stages = (h200 / "session" / "stages.txt").read_text().split("\n")
    # held-out calibration (calib:) for the drafter with a confidence head only
    assert {" ".join(s.split()[:2]) for s in stages if s} == {
        "train:DFlash 0", "train:DSpark 0", "eval:DFlash:t0 0", "eval:DSpark:t0 0", "eval:DFlash:t1 0",
        "eval:DSpark:t1 0", "calib:DSpark:t0 0", "calib:DSpark:t1 0", "batch 0",
    }  # fmt: skip
    names = ("DFlash", "DSpark")
    assert max(times["start", n] for n in names) < min(times["end", n] for n in names)  # overlapping
    assert times["end", "DFlash"] < times["eval", "DFlash"] < times["end", "DSpark"]  # evaluated at once
    assert times["end", "DSpark"] < times["eval", "DSpark"]
    for n in names:  # a run's two temperatures at once: the batch's tail is one evaluation long
        assert max(times["t0", n], times["t1", n]) < min(times["t0_end", n], times["t1_end", n])
    calls = (h200 / "stub_evals.txt").read_text()
    cal = tmp_path / "cal.jsonl"
    assert f"DSpark T=0 engine=fast calibrate=true calibration.file={cal}" in calls
    assert "DFlash T=1 engine=fast\n" in calls  # no confidence head: nothing to calibrate
    t0, t1 = json.loads((h200 / "out" / "table1" / "table1.json").read_text())
    assert list(t0["rows"]) == list(t1["rows"]) == ["DFlash", "DSpark"]
    with tarfile.open(tmp_path / "out" / "bundle.tgz") as tar:
        members = set(tar.getnames())
    assert {"out/table1/table1.json", "out/table1/fig2_acceptance_T0.png", "session/stages.txt"} <= members
    assert "out/table1/dashboard/index.html" in members  # the batch's dashboard, from its evaluations here
    with tarfile.open(tmp_path / "out" / "evals.tgz") as tar:
        members = set(tar.getnames())
    assert "eval_DSpark_t1/results.json" in members
    assert not any(n.endswith(("rounds.jsonl", "generations.jsonl")) for n in members)
    # the held-out calibration of the rounds left behind comes back in their evaluation's folder
    assert {"eval_DSpark_t0/calibration_compare.json", "eval_DSpark_t1/calibration_compare.json"} <= members
    held_out = json.loads((h200 / "eval_DSpark_t1" / "calibration_compare.json").read_text())
    (source,) = held_out["sources"].values()
    assert set(source["methods"]) == {"raw", "sts", "sts_offsets"} and source["rounds"] > 0


def test_session_sweep_evaluates_each_run_of_the_multirun_as_it_finishes(evals, tmp_path):
    """SWEEP: one multirun trains the grid; each of its runs is evaluated once its summary is written,
    while the multirun goes on (the first point's τ does not wait for the last point's training)."""
    grid = {
        "SWEEP": "drafter=dspark head=markov drafter.num_layers=1,2",
        "SWEEP_RUNS": "DSpark-${drafter.num_layers}",
        "BATCH_EVAL_EXTRA": "engine=plain",
    }
    h200, times = _session_batch(evals, tmp_path, BATCH_TEMPERATURES="0", **grid)
    stages = (h200 / "session" / "stages.txt").read_text().split("\n")
    assert {" ".join(s.split()[:2]) for s in stages if s} == {
        "sweep 0",
        "eval:DSpark-A:t0 0",
        "eval:DSpark-B:t0 0",
        "calib:DSpark-A:t0 0",
        "calib:DSpark-B:t0 0",
        "batch 0",
    }
    assert times["end", "DSpark-A"] < times["eval", "DSpark-A"] < times["end", "DSpark-B"]
    assert times["end", "DSpark-B"] < times["eval", "DSpark-B"]
    table = json.loads((h200 / "out" / "table1" / "table1.json").read_text())  # one temperature: one table
    assert table["temperature"] == 0 and list(table["rows"]) == ["DSpark-A", "DSpark-B"]
    assert (h200 / "out" / "table1" / "axis" / "tau_by_num_layers.png").is_file()  # the sweep's τ figure
    # BATCH_EVAL_EXTRA follows the batch's own overrides: it wins
    calls = (h200 / "stub_evals.txt").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith("DSpark-") and c.endswith(" engine=plain") for c in calls)


def test_session_wait_shows_each_run_still_training_with_its_step(tmp_path):
    """`wait` names every run still training with its last logged step and step time (Lightning's CSV:
    a row per metric group, so the latest non-empty value of each) and its last validation, and no run
    that has finished."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "h200_session.sh", tmp_path / "scripts")
    h200 = tmp_path / "outputs" / "h200"
    csv_text = (
        "epoch,lr-AdamW,step,train/step_ms,val/tau_prob,val/c_star_1\n,0.001,9,,,\n0,,9,141.2,,\n"
        "0,,9,,1.8124,0.4567\n,0.0009,19,,,\n"
    )
    for run in ("DSpark-B4", "DSpark-B16"):
        (h200 / run / "logs").mkdir(parents=True)
        (h200 / run / "logs" / "metrics.csv").write_text(csv_text)
    (h200 / "DSpark-B4" / "summary.json").write_text('{"global_step": 19}')
    (h200 / "DSpark-B16" / ".hydra").mkdir()
    (h200 / "DSpark-B16" / ".hydra" / "config.yaml").write_text("trainer:\n  max_steps: 4500\n")
    (h200 / "session").mkdir()
    (h200 / "session" / "stages.txt").write_text("")
    (h200 / "session" / "log.txt").write_text("")
    env = {**ENV, "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", "scripts/h200_session.sh", "wait", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    training = proc.stdout.split("== training\n")[1].split("== log")[0]
    # 4 480 steps left (the log counts from 0) at 141.2 ms: ~633 s
    assert training == (
        "DSpark-B16: step 19, 141 ms a step, ~633 s to step 4500 at that pace;"
        " validation at step 9: tau_prob 1.812, c*_1 0.457\n"
    )


def test_session_data_pack_comes_back_and_unpacks_in_place_of_the_data_stage(tmp_path):
    """`h200_drafter.sh pack` keeps what training reads (build key, DONE.json, prompts, tokens; not
    the answer shards) in <= 15 MiB pieces; `wait` brings pieces back as files of their own; a
    later session's data stage with DATA_PACK unpacks them instead of generating (no data run)."""
    (tmp_path / "scripts").mkdir()
    for script in ("h200_session.sh", "h200_drafter.sh"):
        shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts")
    name = "smollm2_30000_bfloat16"
    data = tmp_path / "outputs" / "h200" / "data" / name
    for rel, text in [("build.json", "{}"), ("DONE.json", '{"conversations": 2}'),
                      ("prompts/val.jsonl", '{"prompt": "hi"}\n'), ("tokens/train.safetensors", "x" * 1000),
                      ("answers/train-00000.jsonl", "not needed\n")]:  # fmt: skip
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_text(text)
    env = {**ENV, "DSPARK_INSTALLED": "1", "OUT": str(tmp_path / "out")}

    def sh(*args, **more):
        return subprocess.run(["bash", *args], cwd=tmp_path, env={**env, **more}, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    packed = sh("scripts/h200_drafter.sh", "pack", "packs")
    assert packed.returncode == 0, packed.stderr
    pieces = sorted((tmp_path / "packs").iterdir())
    assert [p.name for p in pieces] == [f"{name}.tar.xz.aa"]
    shutil.rmtree(tmp_path / "outputs")
    prefix = str(tmp_path / "packs" / f"{name}.tar.xz")
    assert sh("scripts/h200_session.sh", "start", STAGES="data", DATA_PACK=prefix).returncode == 0
    (tmp_path / "outputs" / "h200" / "pack").mkdir(parents=True)
    (tmp_path / "outputs" / "h200" / "pack" / "piece.aa").write_text("p")
    done = sh("scripts/h200_session.sh", "wait", "60")
    assert "PIPELINE DONE" in done.stdout, done.stdout + done.stderr
    stages = (tmp_path / "outputs" / "h200" / "session" / "stages.txt").read_text().split()
    assert stages[:2] == ["data_unpack", "0"]
    assert (data / "tokens" / "train.safetensors").read_text() == "x" * 1000
    assert (data / "prompts" / "val.jsonl").exists() and not (data / "answers").exists()
    assert (tmp_path / "out" / "piece.aa").read_text() == "p"  # a piece comes back on its own
    with tarfile.open(tmp_path / "out" / "bundle.tgz") as tar:
        assert "out/data/DONE.json" in tar.getnames()
    # A prefix with no pieces fails the stage (and ends the pipeline) instead of training on nothing.
    shutil.rmtree(tmp_path / "outputs")
    missing = f"{prefix}-missing"
    assert sh("scripts/h200_session.sh", "start", STAGES="data train", DATA_PACK=missing).returncode == 0
    sh("scripts/h200_session.sh", "wait", "60")
    stages = (tmp_path / "outputs" / "h200" / "session" / "stages.txt").read_text().split()
    assert stages[0] == "data_unpack" and stages[1] != "0" and "train" not in stages


def test_session_keeps_the_trained_drafter_and_a_later_session_restores_it(tmp_path):
    """The ``keep`` stage packs NAME's drafter folder into pieces that `wait` brings back; a later
    session's ``restore`` (DRAFTER_PACK) unpacks them byte for byte as NAME's drafter, and a prefix
    with no pieces ends the pipeline before anything would evaluate a missing drafter."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "h200_session.sh", tmp_path / "scripts")
    drafter = tmp_path / "outputs" / "h200" / "D" / "drafter"
    drafter.mkdir(parents=True)
    weights = bytes(range(256)) * 4000
    (drafter / "model.safetensors").write_bytes(weights)
    (drafter / "config.json").write_text('{"drafter": {}}')
    env = {**ENV, "DSPARK_INSTALLED": "1", "NAME": "D"}

    def session(out, *args, **more):
        return subprocess.run(
            ["bash", "scripts/h200_session.sh", *args],
            cwd=tmp_path,
            timeout=120,
            env={**env, "OUT": str(out), **more},
            capture_output=True,
            text=True,
        )

    assert session(tmp_path / "out", "start", STAGES="keep").returncode == 0
    assert "PIPELINE DONE" in session(tmp_path / "out", "wait", "60").stdout
    assert [p.name for p in (tmp_path / "out").glob("drafter_D.tar.xz.*")] == ["drafter_D.tar.xz.aa"]
    shutil.rmtree(tmp_path / "outputs")
    prefix = str(tmp_path / "out" / "drafter_D.tar.xz")
    assert session(tmp_path / "out2", "start", STAGES="restore", DRAFTER_PACK=prefix).returncode == 0
    session(tmp_path / "out2", "wait", "60")
    assert (drafter / "model.safetensors").read_bytes() == weights
    stages = tmp_path / "outputs" / "h200" / "session" / "stages.txt"
    assert stages.read_text().split()[:2] == ["restore", "0"]
    shutil.rmtree(tmp_path / "outputs")
    missing = f"{prefix}-missing"
    assert session(tmp_path / "out3", "start", STAGES="restore eval0", DRAFTER_PACK=missing).returncode == 0
    session(tmp_path / "out3", "wait", "60")
    recorded = stages.read_text().split()
    assert recorded[0] == "restore" and recorded[1] != "0" and "eval0" not in recorded


def test_session_gputests_stage_runs_the_gpu_tests_and_spares_the_study_them(tmp_path):
    """With the data from a pack nothing else runs the GPU tests: the ``gputests`` stage does
    (the six test files, ``-m gpu``), logs one line per test into the bundle, and the speculation
    study is told they ran. A failing GPU test is recorded and the pipeline goes on."""
    (tmp_path / "scripts").mkdir()
    for script in ("h200_session.sh", "h200_gpu_tests.sh"):
        shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts")
    spec = tmp_path / "scripts" / "h200_speculation.sh"
    spec.write_text('echo "GPU_TESTS_DONE=${GPU_TESTS_DONE:-}" > spec.txt\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (tmp_path / "tests" / "test_kernels.py").write_text(
        "import pytest\n\n@pytest.mark.gpu\ndef test_gpu_kernel():\n    assert True\n\n"
        "def test_cpu_only():\n    raise AssertionError('not a gpu test')\n"
    )
    stubs = {
        "test_drafters": "test_gpu_training_mask",
        "test_draft_vocab": "test_gpu_draft_vocabulary",
        "test_calibration": "test_gpu_sts_fit",
        "test_feature_graphs": "test_gpu_feature_graphs",
    }
    for file, test in stubs.items():
        body = f"import pytest\n\n@pytest.mark.gpu\ndef {test}():\n    assert True\n"
        (tmp_path / "tests" / f"{file}.py").write_text(body)
    outcome = {"pass": "assert True", "fail": "assert False"}
    env = {**ENV, "DSPARK_INSTALLED": "1", "OUT": str(tmp_path / "out"), "STAGES": "gputests spec"}
    for case in ("pass", "fail"):
        (tmp_path / "tests" / "test_fast_engine.py").write_text(
            f"import pytest\n\n@pytest.mark.gpu\ndef test_gpu_engine():\n    {outcome[case]}\n"
        )
        shutil.rmtree(tmp_path / "outputs", ignore_errors=True)
        for step in (["start"], ["wait", "60"]):
            done = subprocess.run(["bash", "scripts/h200_session.sh", *step], cwd=tmp_path, text=True,
                                  capture_output=True, timeout=120, env=env)  # fmt: skip
        assert "PIPELINE DONE" in done.stdout, done.stdout + done.stderr
        stages = [
            line.split()[:2]
            for line in (tmp_path / "outputs" / "h200" / "session" / "stages.txt").read_text().splitlines()
        ]
        log = (tmp_path / "outputs" / "h200" / "out" / "gpu_tests.log").read_text()
        told = (tmp_path / "spec.txt").read_text()
        assert "PASSED tests/test_kernels.py::test_gpu_kernel" in log and "test_cpu_only" not in log
        assert "PASSED tests/test_drafters.py::test_gpu_training_mask" in log
        assert "PASSED tests/test_draft_vocab.py::test_gpu_draft_vocabulary" in log
        assert "PASSED tests/test_calibration.py::test_gpu_sts_fit" in log
        assert "PASSED tests/test_feature_graphs.py::test_gpu_feature_graphs" in log
        if case == "pass":
            assert stages[0] == ["gputests", "0"] and "GPU_TESTS_DONE=1" in told
        else:
            assert stages[0][0] == "gputests" and stages[0][1] != "0"
            assert "FAILED tests/test_fast_engine.py::test_gpu_engine" in log
            assert "GPU_TESTS_DONE=\n" in told  # the study runs its own
        assert stages[1][0] == "spec"


def test_session_gputests_bg_before_generated_data_spares_the_data_stage_its_own_run(tmp_path):
    """``STAGES="gputests_bg data"``: the GPU tests run beside the generation, so the data stage is
    told to skip its own (SKIP_GPU_TESTS=1); a data stage alone still runs them (empty)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "h200_session.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "h200_gpu_tests.sh").write_text("echo ran > gpu_tests_ran.txt\n")
    (tmp_path / "scripts" / "h200_drafter.sh").write_text(
        'echo "$1 $2 SKIP_GPU_TESTS=${SKIP_GPU_TESTS:-}" > data_stage.txt\n'
    )
    env = {**ENV, "DSPARK_INSTALLED": "1", "OUT": str(tmp_path / "out"), "N": "90000"}
    for stages, told in (("gputests_bg data", "SKIP_GPU_TESTS=1"), ("data", "SKIP_GPU_TESTS=\n")):
        shutil.rmtree(tmp_path / "outputs", ignore_errors=True)
        for step in (["start"], ["wait", "60"]):
            done = subprocess.run(["bash", "scripts/h200_session.sh", *step], cwd=tmp_path, text=True,
                                  capture_output=True, timeout=120, env=env | {"STAGES": stages})  # fmt: skip
        assert "PIPELINE DONE" in done.stdout, done.stdout + done.stderr
        data = (tmp_path / "data_stage.txt").read_text()
        assert data.startswith("data 90000 ") and told in data + "\n"
    assert (tmp_path / "gpu_tests_ran.txt").exists()
    # A reader that closes the pipe after one byte still gets the bundle written (it is made first).
    (tmp_path / "out" / "bundle.tgz").unlink()
    subprocess.run("bash scripts/h200_session.sh wait 5 | head -c 1", shell=True, cwd=tmp_path, env=env,
                   capture_output=True, timeout=60)  # fmt: skip
    assert (tmp_path / "out" / "bundle.tgz").exists()


def _recording_tools(tmp_path: Path, *scripts: str) -> dict:
    """A copy of ``scripts`` under tmp_path/scripts, and the environment that runs them with
    ``python3`` and ``nvidia-smi`` that only record their command lines, one a line, in CALLS
    (tmp_path/calls.txt): the scripts' orchestration without the device."""
    (tmp_path / "scripts").mkdir()
    for script in scripts:
        shutil.copy(ROOT / "scripts" / script, tmp_path / "scripts")
    (tmp_path / "bin").mkdir()
    for tool in ("python3", "nvidia-smi"):
        (tmp_path / "bin" / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "$CALLS"\n')
        (tmp_path / "bin" / tool).chmod(0o755)
    return {**ENV, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls.txt")}


def test_drafter_script_data_extra_reaches_the_data_and_the_train_step(tmp_path):
    """DATA_EXTRA (the recipe, e.g. another target answering a staged prompt set) goes to both
    steps, so training asks for the very folder the data step built (its build key includes it)."""
    extra = "data.source=jsonl data.jsonl.path=/root/stage/prompts.jsonl"
    env = {**_recording_tools(tmp_path, "h200_drafter.sh", "h200_data.sh"), "DSPARK_INSTALLED": "1",
           "SKIP_GPU_TESTS": "1", "DATA_EXTRA": extra, "N": "500", "OUT": str(tmp_path / "out")}  # fmt: skip
    for step in (["data", "500"], ["train", "run", "1", "drafter=dspark"]):
        subprocess.run(["bash", "scripts/h200_drafter.sh", *step], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    prepare = [c for c in calls if "dspark.prepare" in c]
    train = [c for c in calls if "dspark.train" in c]
    assert len(prepare) == 1 and len(train) == 1, calls
    for call in (prepare[0], train[0]):
        assert extra in call and "data.num_prompts=500" in call and "smollm2_500_bfloat16" in call


@pytest.mark.parametrize("temperatures", ["1 0", "1,0"])
def test_speculation_script_takes_temperatures_with_spaces_or_commas(tmp_path, temperatures):
    """E2E_TEMPERATURES="1,0" (written as the other lists are) once made every stage refuse it: both
    spellings give each temperature its cost table and e2e run, the first one's diagnostics; a word
    that is not a temperature stops the script before it runs anything."""
    env = {**_recording_tools(tmp_path, "h200_speculation.sh"), "GPU_TESTS_DONE": "1",
           "SPEC_DIAGNOSE": "kernels", "OUT": str(tmp_path / "out")}  # fmt: skip
    calls = Path(env["CALLS"])
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")

    def run(value: str) -> subprocess.CompletedProcess:
        calls.unlink(missing_ok=True)
        command = ["bash", "scripts/h200_speculation.sh", str(drafter)]
        env["E2E_TEMPERATURES"] = value
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    assert run(temperatures).returncode == 0
    lines = calls.read_text().splitlines()
    tables = [c for c in lines if "dspark.bench.engine_sps" in c]
    e2e = [c for c in lines if "dspark.bench.e2e" in c]
    assert [c.split("--temperature ")[1].split()[0] for c in tables] == ["1", "0"], tables
    assert [c.split("--temperature ")[1].split()[0] for c in e2e] == ["1", "0"], e2e
    assert "--kernels 1,256" in tables[0] and "--kernels" not in tables[1]

    bad = run("0,x")
    assert bad.returncode == 2 and "E2E_TEMPERATURES: 'x' is not a temperature" in bad.stdout
    assert not calls.exists()  # not even the install
