"""The benchmark scripts run end to end on the tiny target (CPU: no graph column) and write what
they promise; their numbers are measured on the GPU, never asserted here."""

from __future__ import annotations

import json

from test_evaluate import _bench, _save

from dspark.bench import e2e, engine_sps
from dspark.scheduling.cost import CostModel


def test_engine_sps_writes_json_and_cost_table(tiny_target, tmp_path):
    out, cost = tmp_path / "sps.json", tmp_path / "cost.json"
    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "rnn")
    report = engine_sps.main(
        ["--tokens", "1,4,8", "--widths", "1,4", "--context", "16", "--repeats", "1", "--warmup", "0",
         "--out", str(out), "--cost-table", str(cost), "--drafter-dir", str(drafter), "target=tiny"]
    )  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["rows"] == report["rows"]
    shapes = {(r["rows"], r["width"]) for r in saved["rows"]}
    assert shapes == {(1, 1), (4, 1), (8, 1), (1, 4), (2, 4)}
    for r in saved["rows"]:
        assert r["hf_eager_ms"] > 0 and r["static_eager_ms"] > 0 and "graph_ms" not in r
    model = CostModel.load(cost)
    curve = model.verify_ms
    assert sorted(curve) == [1, 4, 8] and list(curve.values()) == sorted(curve.values())
    assert sorted(int(r) for r in saved["draft_ms"]) == [1, 2, 4, 8]  # every row count measured
    assert sorted(model.draft_ms) == [1, 2, 4, 8] and all(v > 0 for v in model.draft_ms.values())


def test_e2e_compares_target_only_and_drafter(tiny_target, tmp_path):
    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "markov")
    bench = _bench(tmp_path / "bench")
    out = tmp_path / "e2e.json"
    e2e.main(
        ["--drafter-dir", str(drafter), "--benchmark-dir", str(bench), "--prompts", "2",
         "--concurrency", "1,2", "--max-new-tokens", "4", "--policies", "fixed,mtp1",
         "--out", str(out), "target=tiny"]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["run"], r["concurrency"]) for r in rows] == [
        ("target_only", 1), ("dspark/fixed", 1), ("dspark/mtp1", 1),
        ("target_only", 2), ("dspark/fixed", 2), ("dspark/mtp1", 2),
    ]  # fmt: skip
    for r in rows:
        assert r["throughput"] > 0 and r["tau"] >= 1
        if r["run"] == "target_only":
            assert r["tau"] == 1
        else:
            assert r["speedup_per_user"] > 0
