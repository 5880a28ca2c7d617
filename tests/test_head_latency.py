"""python -m dspark.bench.head_latency (Fig. 4's latency panel) end to end on the tiny target, on the
CPU: the table's structure and what must hold whatever the timing noise; bad input refused before
any model is built. Its numbers are measured on the GPU, never asserted here."""

from __future__ import annotations

import json
import math

import pytest

from dspark.bench import head_latency
from dspark.core.errors import ConfigError

FAST = ["--rows", "1", "--context", "8", "--layers", "1", "--repeats", "1", "--warmup", "0"]
FAST += ["--round-tokens", "3", "target=tiny"]
PICKS = {
    "dflash": ["drafter=dflash"],
    "markov": ["drafter=dspark", "head=markov"],
    "rnn": ["drafter=dspark", "head=rnn"],
}


def test_head_latency_table_per_family_block_and_rows(tmp_path):
    out = tmp_path / "head_latency.json"
    argv = [*f"--families dflash,markov,rnn --blocks 4,7 --out {out}".split(), *FAST]
    report = head_latency.main(argv)
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    assert {"command", "commit", "date", "machine"} <= set(saved)  # provenance
    assert saved["target"] == "tiny" and saved["compiled"] is False and saved["layers"] == 1
    assert (saved["families"], saved["blocks"], saved["rows"]) == (["dflash", "markov", "rnn"], [4, 7], [1])
    # Blocks outer, DFlash first: a run cut off has every family at the blocks it finished.
    order = [(r["block_size"], r["family"], r["rows"]) for r in saved["results"]]
    assert order == [(b, f, 1) for b in (4, 7) for f in ("dflash", "markov", "rnn")]
    labels = {"dflash": "DFlash", "markov": "DSpark-Markov", "rnn": "DSpark-RNN"}
    for r in saved["results"]:
        assert r["label"] == labels[r["family"]] and r["gamma"] == r["block_size"]  # slots=anchor
        chosen = [f"drafter.block_size={r['block_size']}", "drafter.num_layers=1"]
        assert r["overrides"] == [*PICKS[r["family"]], *chosen]  # as python -m dspark.train composes it
        assert r["parameters"] > 0
        for key in ("draft_step_ms", "round_ms", "plain_round_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert math.isfinite(r["sequential_head_ms"]) and r["sequential_head_ms"] >= 0
        assert r["head_share"] == pytest.approx(r["sequential_head_ms"] / r["round_ms"])
        assert r["head_us_per_position"] == pytest.approx(1000 * r["sequential_head_ms"] / r["gamma"])
        parts = r["parts"]  # draft_parts' row: what the head's cost is read from
        assert parts["rows"] == 1 and all(math.isfinite(v) and v >= 0 for v in parts.values())
        if r["family"] == "dflash":  # no sequential head: 0 by definition, the round its own reference
            assert r["sequential_head_ms"] == 0 and r["head_share"] == 0 and r["round_vs_dflash"] == 0
        else:
            assert r["sequential_head_ms"] == parts["sequential_head_ms"]
            dflash = next(
                d for d in saved["results"] if d["family"] == "dflash" and d["block_size"] == r["block_size"]
            )
            assert r["round_vs_dflash"] == pytest.approx(r["round_ms"] / dflash["round_ms"] - 1)
    # python -m dspark.report mode=head_latency draws it, the measurement beside the PNG.
    plot = report_head_latency(str(out), tmp_path / "fig")
    assert plot == tmp_path / "fig" / "fig4_latency.png" and plot.stat().st_size > 0
    assert json.loads(plot.with_suffix(".json").read_text()) == saved


def test_head_latency_averages_contexts_as_the_papers_panel(tmp_path):
    """--context with several lengths (the paper's 512-4096): every row measured at each, and
    mean_over_contexts per family, B and R, which the figure draws; a configuration cut off before its
    last context is left out of the means rather than averaged over fewer."""
    out = tmp_path / "head_latency.json"
    fast = [a if a != "8" else "8,24" for a in FAST]  # --context 8,24
    report = head_latency.main(["--families", "dflash,markov", "--blocks", "4", "--out", str(out), *fast])
    assert report["contexts"] == [8, 24]
    assert [(r["family"], r["context"]) for r in report["results"]] == [
        ("dflash", 8), ("dflash", 24), ("markov", 8), ("markov", 24)
    ]  # fmt: skip
    means = {m["family"]: m for m in report["mean_over_contexts"]}
    for family, m in means.items():
        rs = [r for r in report["results"] if r["family"] == family]
        assert m["contexts"] == [8, 24] and (m["block_size"], m["rows"]) == (4, 1)
        for key in ("round_ms", "sequential_head_ms", "draft_step_ms"):
            assert m[key] == pytest.approx((rs[0][key] + rs[1][key]) / 2)
        assert m["head_share"] == pytest.approx(m["sequential_head_ms"] / m["round_ms"])
        assert m["round_vs_dflash"] == pytest.approx(m["round_ms"] / means["dflash"]["round_ms"] - 1)
    cut = head_latency.mean_over_contexts(report["results"][:3])  # markov measured at 8 only
    assert [m["family"] for m in cut] == ["dflash"]
    plot = report_head_latency(str(out), tmp_path / "fig")
    drawn = json.loads(plot.with_suffix(".json").read_text())
    assert drawn["mean_over_contexts"] == report["mean_over_contexts"]


def report_head_latency(runs: str, out_dir):
    from hydra import compose, initialize_config_module

    from dspark.report import run_report

    with initialize_config_module("dspark.conf", version_base="1.3"):
        cfg = compose("report", overrides=["mode=head_latency", f"runs={runs}", f"out_dir={out_dir}"])
    return run_report(cfg)


def test_report_head_latency_names_what_it_reads(tmp_path):
    with pytest.raises(ConfigError, match="mode=head_latency reads JSONs .* runs=<head_latency.json>"):
        report_head_latency(str(tmp_path), tmp_path / "fig")  # a folder, not the JSON
    (tmp_path / "other.json").write_text('{"rows": []}')
    with pytest.raises(ConfigError, match="other.json is no JSON of python -m dspark.bench.head_latency"):
        report_head_latency(str(tmp_path / "other.json"), tmp_path / "fig")
    assert not (tmp_path / "fig").exists()


def test_report_joins_parts_of_the_grid_that_compare(tmp_path):
    """Two sessions' parts of the grid (blocks 4, then 7) on one panel; a part measured otherwise (other
    contexts here; another GPU alike) or a configuration given twice is refused by name, nothing drawn."""
    a, b, rnn = tmp_path / "b4.json", tmp_path / "b7.json", tmp_path / "rnn.json"
    for path, families, block in ((a, "dflash,markov", "4"), (b, "dflash,markov", "7"), (rnn, "rnn", "4")):
        head_latency.main(["--families", families, "--blocks", block, "--out", str(path), *FAST])
    assert "round_vs_dflash" not in json.loads(rnn.read_text())["results"][0]  # no DFlash in its part
    plot = report_head_latency(f"[{a},{b},{rnn}]", tmp_path / "fig")
    drawn = json.loads(plot.with_suffix(".json").read_text())
    assert [s["path"] for s in drawn["sources"]] == [str(a), str(b), str(rnn)]
    assert [(r["label"], r["block_size"]) for r in drawn["rows"]] == [
        ("DFlash", 4), ("DSpark-Markov", 4), ("DFlash", 7), ("DSpark-Markov", 7), ("DSpark-RNN", 4)
    ]  # fmt: skip
    dflash4, rnn4 = drawn["rows"][0], drawn["rows"][-1]  # the RNN relates to the other part's DFlash
    assert rnn4["round_vs_dflash"] == pytest.approx(rnn4["round_ms"] / dflash4["round_ms"] - 1)
    assert drawn["contexts"] == [8] and drawn["target"] == "tiny"
    with pytest.raises(ConfigError, match="DFlash at block 4, R = 1 is in both .*b4.json and .*b4.json"):
        report_head_latency(f"[{a},{a}]", tmp_path / "twice")
    other = json.loads(b.read_text())
    other["contexts"] = [8, 24]
    (tmp_path / "ctx.json").write_text(json.dumps(other))
    differ = r"b4.json and .*ctx.json differ in contexts \(\[8\] against \[8, 24\]\)"
    with pytest.raises(ConfigError, match=differ):
        report_head_latency(f"[{a},{tmp_path / 'ctx.json'}]", tmp_path / "apart")
    assert not (tmp_path / "twice").exists() and not (tmp_path / "apart").exists()


def test_head_latency_keeps_what_it_measured_when_cut_off(tmp_path, monkeypatch):
    out, measured = tmp_path / "h.json", []
    real = head_latency.measure

    def once(*args, **kw):
        if measured:
            raise KeyboardInterrupt
        measured.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(head_latency, "measure", once)
    with pytest.raises(KeyboardInterrupt):
        head_latency.main(["--families", "markov,rnn", "--blocks", "4", *FAST, "--out", str(out)])
    saved = json.loads(out.read_text())
    assert [(r["family"], r["block_size"]) for r in saved["results"]] == [("markov", 4)]
    assert "round_vs_dflash" not in saved["results"][0]  # no DFlash row to compare with


def test_head_latency_serves_every_drafter_a_draft_vocabulary(tmp_path, monkeypatch):
    """--draft-vocab K: every engine of the run (draft steps, rounds, the head's parts) drafts over the
    K most frequent tokens of --draft-vocab-counts, and the report says which and how much they cover."""
    import torch

    from dspark.artifacts import DrafterFolder
    from dspark.bench import sps
    from dspark.decoding.draft_vocab import coverage

    counts = torch.zeros(49152, dtype=torch.long)  # the tiny target's vocabulary (SmolLM2's tokenizer)
    counts[100:200] = torch.arange(100, 0, -1)
    counts_file = DrafterFolder(tmp_path / "counts").write_token_counts(counts)
    served = []
    real_parts = sps._parts_at

    def parts_at(eng, *args, **kw):
        served.append(eng.shared.lm_weight.shape[0])
        return real_parts(eng, *args, **kw)

    real_init = sps.FastEngine.__init__

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        served.append(self.shared.lm_weight.shape[0])

    monkeypatch.setattr(sps, "_parts_at", parts_at)
    monkeypatch.setattr(sps.FastEngine, "__init__", init)
    out, whole_out = tmp_path / "k64.json", tmp_path / "whole.json"
    argv = ["--families", "markov", "--blocks", "4", *FAST]
    k64 = ["--draft-vocab", "64", "--draft-vocab-counts", str(counts_file)]
    report = head_latency.main([*argv, *k64, "--out", str(out)])
    assert len(served) >= 4 and set(served) == {64}  # draft step, rounds, parts' engine, parts
    vocab = report["draft_vocab"]
    assert vocab["size"] == 64 and 0.8 < vocab["coverage"] < 0.87  # 64 of 100 counted tokens
    top = torch.sort(torch.argsort(counts, descending=True, stable=True)[:64]).values
    # the 64 most counted, give or take the EOS ids the vocabulary always holds
    assert vocab["coverage"] == pytest.approx(coverage(counts, top), abs=0.02)
    assert json.loads(out.read_text())["draft_vocab"] == vocab and report["out_of_memory"] == []
    served.clear()
    whole = head_latency.main([*argv, "--out", str(whole_out)])
    assert whole["draft_vocab"] is None and set(served) == {49152}
    with pytest.raises(ConfigError, match="differ in draft_vocab"):  # the two never share a panel
        report_head_latency(f"[{out},{whole_out}]", tmp_path / "fig")


def test_head_latency_goes_on_past_a_configuration_out_of_memory(tmp_path, monkeypatch):
    """A configuration that does not fit (Gemma's DFlash at block 16, R = 128 on an H100): recorded with
    the contexts not measured, its memory given back, and the next configuration measured."""
    import torch

    real = head_latency.measure
    tried = []

    def measure(target, drafter, rows, ctx, args, family, vocab=None):
        tried.append((family, ctx))
        if family == "markov" and ctx == 24:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.62 GiB")
        return real(target, drafter, rows, ctx, args, family, vocab)

    monkeypatch.setattr(head_latency, "measure", measure)
    out = tmp_path / "h.json"
    fast = [a if a != "8" else "8,24,40" for a in FAST]  # --context 8,24,40
    report = head_latency.main(["--families", "markov,rnn", "--blocks", "4", "--out", str(out), *fast])
    assert tried == [("markov", 8), ("markov", 24), ("rnn", 8), ("rnn", 24), ("rnn", 40)]
    assert report["out_of_memory"] == [
        {"family": "markov", "block_size": 4, "contexts": [24, 40], "error": "CUDA out of memory"}
    ]
    assert [(r["family"], r["context"]) for r in report["results"]] == [
        ("markov", 8), ("rnn", 8), ("rnn", 24), ("rnn", 40)
    ]  # fmt: skip
    assert [m["family"] for m in report["mean_over_contexts"]] == ["rnn"]  # no mean over fewer contexts
    assert json.loads(out.read_text())["out_of_memory"] == report["out_of_memory"]


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--families", "dflash,medusa"], r"unknown \['medusa'\]; choose from dflash, markov, gated, rnn"),
        (["--families", ","], "--families is empty"),
        (["--blocks", "1,4"], r"--blocks '1,4': \[1\] below 2; each must be >= 2"),
        (["--blocks", ""], "--blocks is empty: give at least one value"),
        (["--blocks", "4,x"], "not a comma-separated list of integers"),
        (["--rows", "0"], "--rows '0': \\[0\\] below 1"),
        (["--context", "0"], r"--context '0': \[0\] below 1"),
        (["--context", "512,4k"], "--context '512,4k' is not a comma-separated list of integers"),
        (["--blokcs", "4"], r"unknown arguments \['--blokcs', '4'\]"),
        (["drafter.num_heads=3"], "num_heads=3 is not a multiple of num_kv_heads"),
        (["--draft-vocab", "64"], "--draft-vocab 64 needs --draft-vocab-counts: the drafters here are fresh"),
        (["--draft-vocab", "-1"], "--draft-vocab -1 is negative"),
        (
            ["--draft-vocab", "64", "--draft-vocab-counts", "/nowhere"],
            "is neither a token counts file nor a data",
        ),
    ],
)
def test_head_latency_refuses_bad_input_before_building_a_model(argv, problem, tmp_path, monkeypatch):
    def no_models(*args, **kw):
        raise AssertionError("a model was built before the input was checked")

    monkeypatch.setattr("dspark.target.load_target", no_models)
    monkeypatch.setattr("dspark.drafters.build_drafter", no_models)
    with pytest.raises(ConfigError, match=problem):
        head_latency.main([*argv, "target=tiny", "--out", str(tmp_path / "h.json")])
    assert not (tmp_path / "h.json").exists()
