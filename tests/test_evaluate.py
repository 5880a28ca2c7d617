"""python -m dspark.evaluate on the tiny target: every output file, their consistency with the
recorded rounds, calibrate=true, and config errors raised before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, load_group
from hydra import compose, initialize_config_module

from dspark.checkpoints import save_drafter
from dspark.core.errors import ConfigError
from dspark.core.types import TargetDims
from dspark.drafters import build_drafter
from dspark.drafters.registry import drafter_class
from dspark.evaluation import check_config, macro, split_prompts


def _save(target, folder: Path, name: str, head: str = "none", gamma: int = 4) -> Path:
    dc, hc = load_group("drafter", name), load_group("head", head)
    dc.num_layers, dc.block_size = 1, gamma
    hc.rank = 16 if head != "none" else 0
    torch.manual_seed(0)
    save_drafter(build_drafter(TargetDims.of(target), dc, hc), folder, dc, hc, target.describe())
    return folder


def _bench(folder: Path) -> Path:
    folder.mkdir()
    for name, qs in {
        "gsm8k": ["What is 2+3?", "Add 4 and 9.", "Halve 10.", "held out"],
        "mt-bench": ["Say hi.", "Name a colour.", "Tell a joke.", "held out"],
    }.items():
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps({"turns": [q, "second turn"]}) + "\n" for q in qs)
        )
    return folder


def test_evaluate_cli_writes_everything(tiny_target, tmp_path):
    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "markov")
    bench, out = _bench(tmp_path / "bench"), tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "dspark.evaluate",
        "target=tiny",
        f"drafter_dir={drafter}",
        "benchmarks=[gsm8k,mt-bench]",
        f"benchmark_dir={bench}",
        "max_prompts=2",
        "max_new_tokens=6",
        "policy.gamma=null",
        "calibrate=true",
        "calibration.prompts=1",
        "concurrency=2",
        "temperature=1.0",
        "progress=false",
        f"out_dir={out}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for f in (
        "results.json",
        "table.md",
        "acceptance_by_position.png",
        "acceptance_by_position.json",
        "threshold_sweep.png",
        "threshold_sweep.json",
        "rounds.jsonl",
        "generations.jsonl",
        "meta.json",
        "calibration.json",
        "reliability.png",
        "reliability.json",
    ):
        assert (out / f).exists(), f

    res = json.loads((out / "results.json").read_text())
    assert set(res) == {
        "target",
        "drafter",
        "temperature",
        "gamma",
        "policy",
        "draft_vocab",
        "benchmarks",
        "macro",
        "macro_stderr",
    }
    assert res["gamma"] == 4 and res["draft_vocab"] is None  # the drafter's whole block and vocabulary
    assert res["target"] == "tiny" and res["drafter"] == "dspark-markov" and res["temperature"] == 1.0
    assert set(res["macro"]) == {"math", "code", "chat", "all"} and res["macro"]["code"] is None
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    gens = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    for name in ("gsm8k", "mt-bench"):
        b, mine = res["benchmarks"][name], [r for r in rounds if r["benchmark"] == name]
        assert set(b) == {
            "tau", "tau_stderr", "requests", "rounds", "new_tokens", "accept_rate_by_position",
            "request_totals", "request_positions",
        }  # fmt: skip
        assert b["requests"] == 2 and b["tau_stderr"] is not None  # errors: tests/test_table1.py
        assert b["request_totals"] == {  # each prompt's Σ (accepted + 1) and rounds, keyed as the rounds
            req: [
                sum(r["accepted"] + 1 for r in mine if r["request"] == req),
                sum(r["request"] == req for r in mine),
            ]
            for req in {r["request"] for r in mine}
        }
        assert b["rounds"] == len(mine) and len(b["accept_rate_by_position"]) == 4
        accepted, reached = (
            [sum(c[i][k] for c in b["request_positions"].values()) for k in range(4)] for i in (0, 1)
        )  # summed over the requests: the position-wise acceptance itself
        assert b["accept_rate_by_position"] == [a / n if n else None for a, n in zip(accepted, reached)]
        assert b["tau"] == pytest.approx(sum(r["accepted"] + 1 for r in mine) / len(mine))
        ids = sorted(g["id"] for g in gens if g["benchmark"] == name)
        assert ids == [f"{name}/0", f"{name}/1"]  # the held-out last prompt is never reported
        assert b["new_tokens"] == sum(len(g["tokens"]) for g in gens if g["benchmark"] == name)
    assert res["macro"]["all"] == pytest.approx(
        (res["benchmarks"]["gsm8k"]["tau"] + res["benchmarks"]["mt-bench"]["tau"]) / 2
    )
    table = (out / "table.md").read_text()
    assert "| tiny | dspark-markov |" in table and "GSM8K (math)" in table and "MT-Bench (chat)" in table

    cal = json.loads((out / "calibration.json").read_text())
    assert len(cal["temperatures"]) == 4 and len(cal["per_position"]) == 4
    assert {"ece_raw", "ece_sts", "auroc", "brier_raw", "brier_sts", "temperature"} <= set(
        cal["per_position"][0]
    )
    assert {"ece_raw_mean", "ece_sts_mean", "auroc_mean"} <= set(cal)
    # The benchmark rounds used the fitted temperatures.
    r = next(r for r in rounds if r["confidence_logits"])
    expect = torch.sigmoid(torch.tensor(r["confidence_logits"]) / torch.tensor(cal["temperatures"]))
    torch.testing.assert_close(torch.tensor(r["confidence"]), expect)
    sweep = json.loads((out / "threshold_sweep.json").read_text())
    assert set(sweep["sweep"]) == {"math", "chat", "all"} and len(sweep["sweep"]["all"]) == 10
    assert sweep["sweep"]["all"][0]["tokens_per_step"] == 4  # threshold 0 = the full block
    meta = json.loads((out / "meta.json").read_text())
    assert meta["calibration_prompts"] == 2 and meta["report_prompts"] == {"gsm8k": 2, "mt-bench": 2}


def _cfg(*overrides):
    with initialize_config_module(config_module="dspark.conf", version_base="1.3"):
        return compose(config_name="evaluate", overrides=["out_dir=unused", *overrides])


def test_cli_user_error_is_one_line(tmp_path):
    """evaluate shares the entry points' error path: one line, exit 2, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "dspark.evaluate", f"drafter_dir={tmp_path}", f"hydra.run.dir={tmp_path}/h"],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    want = f"dspark: error: drafter_dir={tmp_path} is not a drafter checkpoint (no config.json there)"
    assert proc.stderr.strip() == want


def test_config_errors_before_loading(tiny_target, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="drafter_dir is required"):
        check_config(_cfg())
    with pytest.raises(ConfigError, match="not a drafter checkpoint"):
        check_config(_cfg(f"drafter_dir={tmp_path}"))
    dflash = _save(tiny_target, tmp_path / "dflash", "dflash", gamma=3)
    with pytest.raises(ConfigError, match="no confidence head"):
        check_config(_cfg(f"drafter_dir={dflash}", "policy=threshold"))
    with pytest.raises(ConfigError, match="calibrate=true needs a drafter with a confidence head"):
        check_config(_cfg(f"drafter_dir={dflash}", "calibrate=true", "policy.gamma=3"))
    with pytest.raises(ConfigError, match="policy.gamma=7 exceeds the 3 tokens the drafter in"):
        check_config(_cfg(f"drafter_dir={dflash}", "policy.gamma=7"))
    # The default policy verifies the drafter's own block, whatever its size (issue 21).
    five = _save(tiny_target, tmp_path / "five", "dflash", gamma=5)
    assert check_config(_cfg(f"drafter_dir={five}")).gamma == 5
    assert _cfg(f"drafter_dir={five}").policy.gamma is None
    dspark = _save(tiny_target, tmp_path / "dspark", "dspark", "markov", gamma=4)
    with pytest.raises(ConfigError, match="policy.cost_table"):
        check_config(_cfg(f"drafter_dir={dspark}", "policy=hardware_aware"))
    assert check_config(_cfg(f"drafter_dir={dspark}", "policy=threshold")).kind == "dspark"
    with pytest.raises(ConfigError, match="engine=warp is not one of plain, fast"):
        check_config(_cfg(f"drafter_dir={dspark}", "engine=warp"))
    eagle = _save(tiny_target, tmp_path / "eagle3", "eagle3", gamma=4)
    assert check_config(_cfg(f"drafter_dir={eagle}", "engine=fast", "policy.gamma=4")).kind == "eagle3"
    monkeypatch.setattr(drafter_class("eagle3"), "supports_static_cache", False)  # a drafter without one
    with pytest.raises(ConfigError, match="eagle3 runs on engine=plain"):
        check_config(_cfg(f"drafter_dir={eagle}", "engine=fast", "policy.gamma=4"))
    assert check_config(_cfg(f"drafter_dir={dspark}", "engine=fast", "policy.gamma=4"))


def test_macro_averages():
    b = {"gsm8k": {"tau": 3.0}, "math500": {"tau": 5.0}, "mt-bench": {"tau": 2.0}}
    dom = {"gsm8k": "math", "math500": "math", "mt-bench": "chat"}
    assert macro(b, dom) == {"math": 4.0, "code": None, "chat": 2.0, "all": pytest.approx(10 / 3)}


def test_calibration_split(tmp_path):
    bench = _bench(tmp_path / "bench")
    report, calib = split_prompts(
        _cfg(
            f"benchmark_dir={bench}",
            "benchmarks=[gsm8k,mt-bench]",
            "calibrate=true",
            "calibration.prompts=1",
            "max_prompts=null",
        )
    )
    assert report["gsm8k"] == ["What is 2+3?", "Add 4 and 9.", "Halve 10."]
    assert calib == [("gsm8k", "held out"), ("mt-bench", "held out")]
    # The reported prompts do not depend on whether calibration runs.
    report_off, calib_off = split_prompts(
        _cfg(f"benchmark_dir={bench}", "benchmarks=[gsm8k]", "max_prompts=2")
    )
    assert report_off["gsm8k"] == report["gsm8k"][:2] and calib_off == []
    (tmp_path / "calib.jsonl").write_text(json.dumps({"turns": ["separate"]}) + "\n")
    report_f, calib_f = split_prompts(
        _cfg(
            f"benchmark_dir={bench}",
            "benchmarks=[gsm8k]",
            "calibrate=true",
            f"calibration.file={tmp_path / 'calib.jsonl'}",
            "max_prompts=null",
        )
    )
    assert calib_f == [("calib", "separate")] and len(report_f["gsm8k"]) == 4


def test_calibration_offsets_are_fitted_written_and_applied(tiny_target, tmp_path):
    """calibrate=true calibration.offsets=true: STS with offsets fitted on the held-out prompts, its
    temperatures and offsets in calibration.json (which Calibration.load reads back) and per position,
    and the benchmark rounds' confidences σ(z / T + b) with them."""
    from dspark import evaluate
    from dspark.calibration.sts import Calibration

    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "markov")
    out = tmp_path / "out"
    cfg = _cfg(
        "target=tiny",
        "target.tiny.initializer_range=0.02",  # near-uniform: drafts are accepted often at T = 1
        f"drafter_dir={drafter}",
        "benchmarks=[gsm8k,mt-bench]",
        f"benchmark_dir={_bench(tmp_path / 'bench')}",
        "max_prompts=2",
        "max_new_tokens=16",
        "calibrate=true",
        "calibration.prompts=1",
        "calibration.offsets=true",
        "concurrency=2",
        "temperature=1.0",
        "progress=false",
        f"out_dir={out}",
    )
    evaluate.run(cfg)
    report = json.loads((out / "calibration.json").read_text())
    cal = Calibration.load(out / "calibration.json")
    assert report["method"] == "sts_offsets" and cal.offsets == report["offsets"] and len(cal.offsets) == 4
    assert any(b != 0 for b in cal.offsets)  # a fitted pair, not the identity of a one-class position
    assert [p["offset"] for p in report["per_position"]] == cal.offsets
    assert [p["temperature"] for p in report["per_position"]] == cal.temperatures
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    temps, offsets = torch.tensor(cal.temperatures), torch.tensor(cal.offsets)
    for r in rounds:
        z = torch.tensor(r["confidence_logits"])
        torch.testing.assert_close(torch.tensor(r["confidence"]), torch.sigmoid(z / temps + offsets))


def test_fast_engines_of_one_evaluation_share_one_cache_capacity(tiny_target, tmp_path, monkeypatch):
    """engine=fast: the calibration's engine and every benchmark's are sized alike, for the longest
    prompt of the whole run (a capacity per call would give the short benchmark a smaller cache, and
    the compiled layers a new cache shape to recompile for)."""
    from dspark import evaluate
    from dspark.decoding.fast_engine import cache_capacity
    from dspark.evaluation import evaluator

    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "markov")
    bench = tmp_path / "bench"
    bench.mkdir()
    long_question = "Sum these numbers: " + " ".join(str(n) for n in range(200)) + "."
    for name, qs in {"gsm8k": [long_question, "held out"], "mt-bench": ["Say hi.", "held out"]}.items():
        (bench / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in qs))
    engines, build = [], evaluator.build_engine

    def recorded(*args, **kw):
        engines.append(build(*args, **kw))
        return engines[-1]

    monkeypatch.setattr(evaluator, "build_engine", recorded)
    cfg = _cfg(
        "target=tiny", f"drafter_dir={drafter}", "benchmarks=[gsm8k,mt-bench]", f"benchmark_dir={bench}",
        "max_prompts=1", "max_new_tokens=8", "calibrate=true", "calibration.prompts=1", "engine=fast",
        "concurrency=2", "temperature=0", "progress=false", f"out_dir={tmp_path / 'out'}",
    )  # fmt: skip
    evaluate.run(cfg)
    longest = len(tiny_target.prompt_ids(long_question)) + 8
    short = len(tiny_target.prompt_ids("Say hi.")) + 8
    gamma = engines[0]._gamma
    assert cache_capacity(short, gamma) < cache_capacity(longest, gamma)  # the case this is about
    assert len(engines) == 3  # calibration, gsm8k, mt-bench
    assert {e.static.capacity for e in engines} == {cache_capacity(longest, gamma)}
