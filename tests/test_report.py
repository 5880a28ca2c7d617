"""The ablation dashboard: run discovery and sweep-axis detection on synthetic folders (fast), then a
dashboard from two real tiny runs (head.rank 4 vs 8, each evaluated inside its folder), the
`python -m dspark.report` CLI, a W&B offline run with no network, and a headless Chromium look."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BENCHMARKS, ROOT
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from dspark.reporting.dashboard import SECTIONS, build_dashboard, md_to_html, publish_run
from dspark.reporting.runs import AxisError, find_runs, label_runs, sweep_axis

# Seconds, not minutes: 2 steps, one validation batch, a dozen short prompts.
SMOKE = [
    "experiment=cpu_smoke",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "data.num_prompts=12",
    "data.max_new_tokens=16",
]


# ----------------------------------------------------------------------------------------------
# synthetic folders


def fake_run(d: Path, head="markov", rank=256, block=7, drafter="dspark", layers=1, **extra) -> Path:
    cfg = {
        "run_name": f"{drafter}-{head}",
        "out_dir": str(d),
        "seed": 0,
        "drafter": {"name": drafter, "block_size": block, "num_layers": layers},
        "head": {"name": head, "rank": rank},
        "loss": {"tv": 0.0 if drafter == "dflash" else 0.9},
        "data": {"dir": str(d / "data")},
        "target": {"name": "tiny"},
        **extra,
    }
    d.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(cfg), d / "config.yaml")
    final = {
        "val/tau_prob": 1.0 + rank / 512,
        "val/loss": 2.0 - rank / 512,
        "val/c_star_1": 0.5,
        "val/c_star_2": 0.4,
    }
    (d / "summary.json").write_text(
        json.dumps({"run_name": cfg["run_name"], "global_step": 2, "final": final})
    )
    (d / "logs").mkdir()
    (d / "logs" / "metrics.csv").write_text("epoch,step,train/loss,val/loss\n0,0,3.0,\n0,1,2.5,\n0,1,,2.4\n")
    (d / "drafter").mkdir()
    (d / "drafter" / "config.json").write_text(
        json.dumps({"drafter": cfg["drafter"], "head": cfg["head"], "target": {"name": "tiny"}})
    )
    return d


def fake_eval(
    d: Path, drafter_dir: Path | None, tau=2.0, totals: dict | None = None, temperature: float = 1.0
) -> Path:
    """``totals``: each benchmark's per-request (Σ (accepted + 1), rounds), for paired comparisons."""
    d.mkdir(parents=True)
    res = {
        "target": "tiny",
        "drafter": "dspark-markov",
        "temperature": temperature,
        "policy": {"name": "fixed", "gamma": 7},
        "benchmarks": {
            "gsm8k": {"tau": tau, "rounds": 3, "new_tokens": 6, "accept_rate_by_position": [0.5, None]},
            "mt-bench": {
                "tau": tau + 0.5,
                "rounds": 3,
                "new_tokens": 7,
                "accept_rate_by_position": [0.6, 0.3],
            },
        },
        "macro": {"math": tau, "chat": tau + 0.5, "all": tau + 0.25},
    }
    for name, per_request in (totals or {}).items():
        res["benchmarks"][name]["request_totals"] = per_request
    (d / "results.json").write_text(json.dumps(res))
    (d / "calibration.json").write_text(
        json.dumps(
            {
                "per_position": [
                    {"position": 1, "ece_raw": 0.3, "ece_sts": 0.1, "auroc": 0.7},
                    {"position": 2, "ece_raw": 0.2, "ece_sts": float("nan"), "auroc": None},
                ],
                "ece_raw_mean": 0.25,
            }
        )
    )
    if drafter_dir is not None:
        (d / "meta.json").write_text(json.dumps({"drafter_dir": str(drafter_dir)}))
    return d


def test_tau_by_axis_draws_each_family_along_the_key_and_one_at_a_single_value_as_a_level(tmp_path):
    """Fig. 3's layout through python -m dspark.report mode=tau_by_axis: DSpark at 1 and 2 layers, DFlash
    at 2 only (its level), each evaluation's temperature a row; two evaluations of one family, value and
    temperature are refused by name."""
    from hydra import compose, initialize_config_module

    from dspark.report import run_report

    for name, layers, tau in (("dspark", 1, 2.0), ("dspark", 2, 3.0), ("dflash", 2, 2.5)):
        head, rank = ("markov", 256) if name == "dspark" else ("none", 0)
        run = fake_run(
            tmp_path / "runs" / f"{name}{layers}", drafter=name, head=head, rank=rank, layers=layers
        )
        per_request = {b: {"r0": [int(4 * tau), 2], "r1": [int(3 * tau), 2]} for b in ("gsm8k", "mt-bench")}
        fake_eval(run / "eval", run / "drafter", tau=tau, totals=per_request)
    with initialize_config_module("dspark.conf", version_base="1.3"):
        args = ["mode=tau_by_axis", f"runs={tmp_path / 'runs'}", "axis=drafter.num_layers"]
        cfg = compose("report", overrides=[*args, f"out_dir={tmp_path / 'out'}"])
    path = run_report(cfg)
    assert path == tmp_path / "out" / "tau_by_num_layers.png" and path.is_file()
    data = json.loads(path.with_suffix(".json").read_text())
    assert data["axis"] == "drafter.num_layers" and data["levels"] == ["dflash none"]
    got = sorted((p["series"], p["value"], p["temperature"], p["tau"]["all"]) for p in data["points"])
    want = [("dflash none", 2, 1.0, 2.75), ("dspark markov", 1, 1.0, 2.25), ("dspark markov", 2, 1.0, 3.25)]
    assert got == want  # each line named by its drafter and head, as a lone family's is
    table = path.with_suffix(".md").read_text()
    assert "| dspark markov | 2 | 1 | 3.00 | – | 3.50 | 3.25 |" in table  # these results carry no errors
    # Each DSpark depth against DFlash's level (once: not again as two families at 2 layers), then along.
    got = [(c["kind"], c["row"]["value"], c["baseline"]["series"]) for c in data["paired"]]
    assert got == [("level", 1, "dflash none"), ("level", 2, "dflash none"), ("axis", 2, "dspark markov")]
    fake_eval(tmp_path / "runs" / "dspark2" / "eval_again", tmp_path / "runs" / "dspark2" / "drafter")
    with pytest.raises(AxisError, match="both dspark markov at drafter.num_layers=2, T = 1.0: give one"):
        run_report(cfg)


def test_tau_by_axis_names_a_lone_family_by_its_drafter_and_head(tmp_path):
    """One family's block-size sweep (Fig. 4, a session per family) splits into no series: its line is
    still named by what it is, so the figures of several sessions read alike."""
    from dspark.reporting.axis_figure import tau_points

    for block in (4, 16):
        run = fake_run(tmp_path / f"b{block}", block=block)
        fake_eval(run / "eval", run / "drafter")
    runs = find_runs(str(tmp_path))
    axis = sweep_axis(runs)
    assert axis.key == "drafter.block_size" and axis.series == []
    got = [(p["series"], p["value"]) for p in tau_points(runs, axis)]
    assert got == [("dspark markov", 4), ("dspark markov", 16)]


def test_tau_by_axis_pairs_families_at_each_value_and_values_along_each_family(tmp_path):
    """The differences Fig. 4 is read for, paired on the same prompts: DSpark against DFlash at each
    block, each family from one block to the next. An evaluation without per-request totals (an older
    session's row) pairs with nothing: the next block is compared with the nearest earlier one that pairs."""
    from dspark.decoding.uncertainty import paired_comparison
    from dspark.reporting.axis_figure import tau_by_axis

    def totals(k: int) -> dict:  # two benchmarks, three requests each: (Σ (accepted + 1), rounds)
        return {
            b: {f"r{i}": [6 + k * (i + 1) + j, 3] for i in range(3)}
            for j, b in enumerate(("gsm8k", "mt-bench"))
        }

    made = {}
    for name, block, k in (
        ("dflash", 4, 0),
        ("dflash", 16, 1),
        ("dspark", 4, 2),
        ("dspark", 8, None),
        ("dspark", 16, 4),
    ):
        head, rank = ("markov", 256) if name == "dspark" else ("none", 0)
        run = fake_run(tmp_path / f"{name}{block}", drafter=name, head=head, rank=rank, block=block)
        made[name, block] = None if k is None else totals(k)
        fake_eval(run / "eval", run / "drafter", totals=made[name, block])
    path, table = tau_by_axis(find_runs(str(tmp_path)), tmp_path / "out", axis="drafter.block_size")
    pairs = json.loads(path.with_suffix(".json").read_text())["paired"]
    got = [
        (c["kind"], c["row"]["series"], c["row"]["value"], c["baseline"]["series"], c["baseline"]["value"])
        for c in pairs
    ]
    assert got == [
        ("families", "dspark markov", 4, "dflash none", 4),
        ("families", "dspark markov", 16, "dflash none", 16),
        ("axis", "dflash none", 16, "dflash none", 4),
        ("axis", "dspark markov", 16, "dspark markov", 4),  # block 8 pairs with nothing
        ("gap", "dspark markov − dflash none", 16, "dspark markov − dflash none", 4),
    ]
    axis, gap = pairs[-2], pairs[-1]
    want = paired_comparison(made["dspark", 16], made["dspark", 4])
    assert axis["difference"] == pytest.approx(want["difference"]) and want["difference"] > 0
    assert axis["stderr"] == pytest.approx(want["difference_stderr"])
    assert axis["ratio"] == pytest.approx(want["ratio"])
    assert "| 1 | dspark markov block_size=16 | dspark markov block_size=4 |" in table
    # The lead's growth: DSpark − DFlash at 16 minus the same at 4, its error over the four evaluations.
    lead = [paired_comparison(made["dspark", b], made["dflash", b])["difference"] for b in (16, 4)]
    assert gap["difference"] == pytest.approx(lead[0] - lead[1]) and gap["ratio"] is None
    assert gap["stderr"] > 0
    assert "_totals" not in json.dumps(json.loads(path.with_suffix(".json").read_text())["points"])


def test_rank_sweep_axis_puts_head_none_at_rank_zero(tmp_path):
    fake_run(tmp_path / "a", head="none", rank=32)  # a preset's rank, ignored without a head
    for r in (512, 32):
        fake_run(tmp_path / f"r{r}", rank=r)
    runs = find_runs(str(tmp_path))
    axis = sweep_axis(runs)
    assert axis.key == "head.rank" and axis.series == []  # head.name follows from the rank
    assert [axis.value(r) for r in axis.order(runs)] == [0, 32, 512]


def test_head_type_axis_and_series(tmp_path):
    for h in ("rnn", "none", "markov"):
        fake_run(tmp_path / h, head=h, rank=0 if h == "none" else 256)
    runs = find_runs(str(tmp_path))
    axis = sweep_axis(runs)
    assert axis.key == "head.name"
    assert [axis.value(r) for r in axis.order(runs)] == ["none", "markov", "rnn"]

    # Block size across two drafters: γ on the x-axis, one line per drafter, loss weights dropped.
    mixed = tmp_path / "mixed"
    for g in (4, 8):
        fake_run(mixed / f"dflash{g}", head="none", rank=0, block=g, drafter="dflash")
        fake_run(mixed / f"dspark{g}", block=g)
    runs = find_runs(str(mixed))
    axis = sweep_axis(runs)
    assert axis.key == "drafter.block_size" and axis.series == ["drafter.name"], axis
    assert sorted({axis.series_label(r) for r in runs}) == ["dflash none", "dspark markov"]
    label_runs(runs, axis)
    assert len({r.label for r in runs}) == 4
    # Fig. 4's three families: the head no longer follows from the drafter and splits lines itself.
    for g in (4, 8):
        fake_run(mixed / f"rnn{g}", head="rnn", block=g)
    runs = find_runs(str(mixed))
    axis = sweep_axis(runs, prefer="drafter.block_size")  # three heads outnumber two blocks here
    assert axis.series == ["drafter.name", "head.name"], axis
    assert sorted({axis.series_label(r) for r in runs}) == ["dflash none", "dspark markov", "dspark rnn"]
    with pytest.raises(AxisError):
        sweep_axis(runs, prefer="no.such.key")


def test_a_comparison_of_drafters_is_labelled_by_their_names(tmp_path):
    """DFlash against DSpark-Gated: drafter, head, rank and loss weights all co-vary (one factor).
    The axis and the labels are its names, not the first key by priority (rank=0 / rank=256)."""
    fake_run(tmp_path / "dflash", head="none", rank=0, drafter="dflash")
    fake_run(tmp_path / "gated", head="gated", rank=256)
    runs = find_runs(str(tmp_path))
    axis = sweep_axis(runs)
    assert axis.key == "drafter.name" and axis.names == ["drafter.name", "head.name"] and axis.series == []
    label_runs(runs, axis)
    assert sorted(r.label for r in runs) == ["dflash none", "dspark gated"]
    assert [axis.value(r) for r in axis.order(runs)] == ["dflash", "dspark"]
    # Asked for an axis, the caller gets that key's values as labels.
    axis = sweep_axis(runs, prefer="head.rank")
    label_runs(runs, axis)
    assert axis.names == [] and sorted(r.label for r in runs) == ["rank=0", "rank=256"]


def test_table1_rows_are_labelled_drafter_first(tmp_path):
    """Table 1's five drafters: the head has the most levels and becomes the axis, the drafter its series;
    the labels still read drafter first, as the sweep figures' series do."""
    for drafter, head, rank in (("dflash", "none", 0), ("eagle3", "none", 0), ("dspark", "markov", 256)):
        fake_run(tmp_path / f"{drafter}-{head}", head=head, rank=rank, drafter=drafter)
    for head in ("gated", "rnn"):
        fake_run(tmp_path / f"dspark-{head}", head=head)
    runs = find_runs(str(tmp_path))
    axis = sweep_axis(runs)
    assert axis.key == "head.name" and "drafter.name" in axis.series
    label_runs(runs, axis)
    assert sorted(r.label for r in runs) == [
        "dflash none",
        "dspark gated",
        "dspark markov",
        "dspark rnn",
        "eagle3 none",
    ]


def test_evaluations_join_their_runs(tmp_path):
    run = fake_run(tmp_path / "train" / "a", rank=64)
    fake_eval(run / "eval", run / "drafter")  # inside
    fake_eval(tmp_path / "train" / "a_eval_t0", run / "drafter", 3)  # next to it
    elsewhere = fake_eval(tmp_path / "evaluate" / "x", run / "drafter", 4)
    orphan = fake_eval(tmp_path / "evaluate" / "orphan", tmp_path / "gone" / "drafter", 5)

    runs = find_runs(str(tmp_path / "train" / "a"))
    assert len(runs) == 1 and len(runs[0].evaluations) == 2
    runs = find_runs([str(run), str(tmp_path / "evaluate" / "*")])
    by_path = {r.path: r for r in runs}
    assert len(by_path[run.resolve()].evaluations) == 3
    assert any(e.path == elsewhere.resolve() for e in by_path[run.resolve()].evaluations)
    lone = [r for r in runs if r.path != run.resolve()]
    assert len(lone) == 1 and lone[0].evaluations[0].path == orphan.resolve()  # an evaluation given directly
    # Given only the evaluation, its training run comes with it.
    only = find_runs(str(elsewhere))
    assert only[0].path == run.resolve() and only[0].summary["global_step"] == 2
    with pytest.raises(FileNotFoundError):
        find_runs(str(tmp_path / "missing"))


def test_published_evaluations_join_the_run_folder_of_their_name(tmp_path):
    """docs/results keeps a run's summary and config without its drafter folder, and its
    evaluations still name the drafter where it was trained (outputs/h200/<name>/drafter): each
    joins the one given run folder of that name; an ambiguous name joins none."""
    pub = tmp_path / "published"
    for name, rank in (("DSpark-Gated", 256), ("DFlash", 0)):
        run = fake_run(pub / name, head="gated" if rank else "none", rank=rank)
        shutil.rmtree(run / "drafter")
        for t in (0, 1):
            fake_eval(pub / f"eval_{name}_t{t}", Path("outputs/h200") / name / "drafter")
        (run / "logs" / "metrics.csv").rename(run / "metrics.csv")  # published at the top
    runs = find_runs([str(pub / "*")])
    assert sorted((r.path.name, len(r.evaluations)) for r in runs) == [("DFlash", 2), ("DSpark-Gated", 2)]
    assert all(r.curves["train/loss"] == [(0, 3.0), (1, 2.5)] for r in runs)
    # A rerun of that name published in another session's folder, given with one of the first
    # session's runs: it takes its own evaluations, not its namesake's that sit beside that run.
    rerun = fake_run(tmp_path / "later" / "DFlash", rank=0)
    shutil.rmtree(rerun / "drafter")
    fake_eval(tmp_path / "later" / "eval_DFlash_t0", Path("outputs/h200/DFlash/drafter"), 4)
    runs = find_runs([str(pub / "DSpark-Gated"), str(rerun)])
    assert sorted((r.path.name, len(r.evaluations)) for r in runs) == [("DFlash", 1), ("DSpark-Gated", 2)]
    (later,) = [r for r in runs if r.path.name == "DFlash"]
    assert later.evaluations[0].path == (tmp_path / "later" / "eval_DFlash_t0").resolve()
    fake_run(tmp_path / "other" / "DFlash", rank=0)  # a second run of that name
    runs = find_runs([str(pub / "*"), str(tmp_path / "other" / "DFlash")])
    assert sum(len(r.evaluations) for r in runs if r.path.name == "DFlash") == 0


def test_synthetic_dashboard_and_markdown(tmp_path):
    for r in (8, 64):
        run = fake_run(tmp_path / "runs" / f"r{r}", rank=r)
        fake_eval(run / "eval", run / "drafter", tau=1 + r / 32)
    index = build_dashboard(find_runs(str(tmp_path / "runs")), tmp_path / "out", title="t")
    page = index.read_text()
    for key in SECTIONS:
        assert f'id="{key}"' in page
    for fig in ("sweep_axis", "tau_by_benchmark", "acceptance_by_position", "calibration", "loss_curves"):
        assert (
            f"figures/{fig}.png" in page
            and (tmp_path / "out" / "figures" / f"{fig}.png").stat().st_size > 5000
        )
    tau = (tmp_path / "out" / "tables" / "tau.md").read_text()
    assert "rank=8" in tau and "rank=64" in tau and "**3.25**" in tau  # best macro bold
    assert not (tmp_path / "out" / "tables" / "paired.md").exists()  # no per-request totals: nothing pairs


def test_dashboard_panels_split_by_temperature_and_name_runs_once(tmp_path):
    """Runs evaluated at two temperatures: the τ figure and the acceptance figure get a panel (row) per
    evaluation tag, so a bar or line is named by its run alone (eleven runs at two temperatures had been
    22 bars a group under a legend taller than the figure)."""
    from dspark.reporting.dashboard import _eval_rows, tau_panels

    for r in (8, 64):
        run = fake_run(tmp_path / "runs" / f"r{r}", rank=r)
        for t in (0.0, 1.0):
            fake_eval(run / f"eval_t{t:g}", run / "drafter", tau=1 + r / 32 + t, temperature=t)
    runs = find_runs(str(tmp_path / "runs"))
    build_dashboard(runs, tmp_path / "out", title="t")  # labels the runs by the swept key
    panels = tau_panels(_eval_rows(runs))
    assert [tag for tag, _ in panels] == ["fixed γ=7 T=0.0", "fixed γ=7 T=1.0"]
    for tag, rows in panels:
        assert sorted(r.label for r, _ in rows) == ["rank=64", "rank=8"]
        assert all(ev.tag == tag for _, ev in rows)
    acc = json.loads((tmp_path / "out" / "figures" / "acceptance_by_position.json").read_text())["curves"]
    assert list(acc)[:4] == [
        "Math, fixed γ=7 T=0.0",
        "Chat, fixed γ=7 T=0.0",
        "Math, fixed γ=7 T=1.0",
        "Chat, fixed γ=7 T=1.0",
    ]
    assert sorted(acc["Chat, fixed γ=7 T=1.0"]) == [
        "rank=64",
        "rank=8",
    ]  # the tag is the panel's, not the line's


def test_many_lines_get_distinct_colours_and_one_legend_beside_the_panels(monkeypatch, tmp_path):
    from dspark.reporting import plots

    assert len(set(plots.distinct_colors(22))) == 22  # tab20 cycled would repeat two
    assert plots.distinct_colors(3) == [plots.plt.get_cmap("tab10")(i) for i in range(3)]
    drawn = {}

    def keep(fig, path, data, **kw):
        drawn["fig"] = fig
        return path

    monkeypatch.setattr(plots, "save_figure", keep)
    few = {"math": {"a": [0.5, 0.4]}, "code": {"a": [0.6, 0.5], "b": [0.7, None]}}
    plots.acceptance_by_position_plot(few, tmp_path / "few.png")
    axes = [ax for ax in drawn["fig"].axes if ax.get_visible()]
    assert len(axes) == 2 and all(ax.get_legend() is not None for ax in axes)  # Fig. 2: a legend a panel
    colour = {ln.get_label(): ln.get_color() for ax in axes for ln in ax.get_lines()}
    assert len(set(colour.values())) == 2  # "a" keeps its colour across the panels
    many = {
        f"{d}, T={t}": {f"run{i}": [0.5, 0.4] for i in range(9)}
        for t in (0, 1)
        for d in ("math", "code", "chat")
    }
    plots.acceptance_by_position_plot(many, tmp_path / "many.png", per_row=3)
    fig = drawn["fig"]
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 6 and len(fig.axes) == 6  # two rows of three
    assert [ax.get_legend() is not None for ax in visible] == [False, False, True, False, False, False]
    assert len(visible[2].get_legend().get_texts()) == 9


def test_dashboard_legends_move_beside_the_panels_past_six_runs(monkeypatch, tmp_path):
    """Calibration and loss figures: the runs' legend sits in the first panel for a few runs and beside
    the last one for more (inside, seven entries covered the lines); each run named once."""
    from dspark.reporting import dashboard

    drawn = {}
    keep = dashboard._save

    def capture(fig, path):
        drawn[path.stem] = [(ax.get_legend() is not None, len(ax.get_lines())) for ax in fig.axes]
        return keep(fig, path)

    monkeypatch.setattr(dashboard, "_save", capture)
    for n in (3, 7):
        for r in range(n):
            run = fake_run(tmp_path / f"n{n}" / f"r{r}", rank=8 * (r + 1))
            fake_eval(run / "eval", run / "drafter", tau=1 + r / 8)
        build_dashboard(find_runs(str(tmp_path / f"n{n}")), tmp_path / f"out{n}", title="t")
        for fig in ("calibration", "loss_curves"):
            legends = [has for has, _ in drawn[fig]]
            assert legends == (
                [True] + [False] * (len(legends) - 1) if n == 3 else [False] * (len(legends) - 1) + [True]
            )


def test_dashboard_sweep_shows_the_paired_differences(tmp_path):
    """Evaluations that carry each request's totals: the sweep section adds which differences along the
    sweep exceed prompt noise (the same rows as mode=tau_by_axis writes)."""
    for r, k in ((8, 1), (64, 3)):
        run = fake_run(tmp_path / "runs" / f"r{r}", rank=r)
        per_request = {
            b: {f"q{i}": [4 + k * i + j, 2] for i in range(3)} for j, b in enumerate(("gsm8k", "mt-bench"))
        }
        fake_eval(run / "eval", run / "drafter", totals=per_request)
    index = build_dashboard(find_runs(str(tmp_path / "runs")), tmp_path / "out", title="t")
    paired = (tmp_path / "out" / "tables" / "paired.md").read_text()
    assert "| 1 | dspark markov rank=64 | dspark markov rank=8 |" in paired
    assert "tables/paired.md" in index.read_text()
    html = md_to_html("| a | b |\n|---|---|\n| x\\|y | **1** |\n")
    assert "<td>x|y</td>" in html and "<b>1</b>" in html


# ----------------------------------------------------------------------------------------------
# real tiny runs


def _train(overrides: list[str]) -> None:
    from dspark.training import run_training

    with initialize_config_module("dspark.conf", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    run_training(cfg)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    """Two real runs on the tiny target that differ in head.rank, each evaluated into <run>/eval."""
    from dspark import evaluate

    base = tmp_path_factory.mktemp("sweep")
    for rank in (4, 8):
        run = base / "runs" / f"rank{rank}"
        _train([*SMOKE, f"head.rank={rank}", f"data.dir={base / 'data'}", f"out_dir={run}"])
        with initialize_config_module("dspark.conf", version_base="1.3"):
            ecfg = compose(
                "evaluate",
                overrides=[
                    "target=tiny",
                    f"drafter_dir={run / 'drafter'}",
                    f"out_dir={run / 'eval'}",
                    "benchmarks=[gsm8k,mt-bench]",
                    "max_prompts=1",
                    "max_new_tokens=4",
                    "progress=false",
                    f"benchmark_dir={BENCHMARKS}",
                ],
            )
        evaluate.run(ecfg)
    return base


def test_dashboard_from_two_tiny_runs(tiny_sweep, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dspark.report",
            f"runs={tiny_sweep / 'runs'}",
            f"hydra.run.dir={tmp_path}",
            "title=tiny rank sweep",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    page = (tmp_path / "index.html").read_text()
    data = json.loads((tmp_path / "dashboard.json").read_text())
    assert data["axis"] == "head.rank" and [r["axis_value"] for r in data["runs"]] == [4, 8]
    for key in SECTIONS:
        sec = data["sections"][key]
        assert f'id="{key}"' in page
        assert sec["figures"] or key == "runs", (key, sec["notes"])
        assert sec["tables"], key
        for fig in sec["figures"]:
            assert (tmp_path / fig).stat().st_size > 5000
    assert "rank=4" in page and "rank=8" in page and "<img" in page
    tau = (tmp_path / "tables" / "tau.md").read_text()
    assert "GSM8K" in tau and "MT-Bench" in tau
    # The sweeps' metric is one that training logs.
    summary = json.loads((tiny_sweep / "runs" / "rank4" / "summary.json").read_text())
    for path in (ROOT / "sweeps").glob("*.yaml"):
        import yaml

        assert yaml.safe_load(path.read_text())["metric"]["name"] in summary["final"], path.name

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("no chromium for the screenshot")
    shot = tmp_path / "screenshot.png"
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            "--window-size=1400,2400",
            (tmp_path / "index.html").as_uri(),
        ],
        capture_output=True,
        timeout=60,
    )
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)
    assert img.shape[0] >= 2000 and img[..., :3].std() > 0.05  # a rendered page, not a blank one


def test_wandb_offline_run_writes_its_folder(tiny_sweep, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline must be the default
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # any network attempt would fail
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    run = tmp_path / "run"
    from lightning.pytorch.loggers import WandbLogger

    try:
        _train(
            [
                *SMOKE,
                "trainer.max_steps=1",
                "trainer.val_check_interval=1",
                "head.rank=4",
                "logger=wandb",
                "logger.group=test",
                "logger.tags=[smoke]",
                f"data.dir={tiny_sweep / 'data'}",
                f"out_dir={run}",
            ]
        )
        assert wandb.run is not None and wandb.run.settings.mode == "offline"
        assert wandb.run.group == "test" and wandb.run.config["head"]["rank"] == 4
        publish_run([WandbLogger()], run)  # reuses the live run: figures and tables of this run
    finally:
        wandb.finish()
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))
    media = offline[0] / "files" / "media"
    assert list(media.rglob("*.png")) and list(media.rglob("*.table.json"))
    assert (run / "summary.json").is_file() and (run / "report" / "index.html").is_file()


def test_tensorboard_runs_give_loss_curves(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    run = fake_run(tmp_path / "tbrun", rank=16)
    (run / "logs" / "metrics.csv").unlink()
    writer = SummaryWriter(str(run / "tb"))
    for step, loss in enumerate((3.0, 2.0, 1.5)):
        writer.add_scalar("train/loss", loss, step)
    writer.close()
    (curves,) = [r.curves for r in find_runs(str(run))]
    assert [v for _, v in curves["train/loss"]] == [3.0, 2.0, 1.5]


def test_loss_table_says_how_fast_each_run_still_rose(tmp_path):
    """The loss table's convergence column: validation τ_prob's rise per 1 000 steps between the last
    two validations (a run at a plateau reads near 0); none with a single validation."""
    rising = fake_run(tmp_path / "runs" / "rising", rank=64)
    (rising / "logs" / "metrics.csv").write_text(
        "epoch,step,train/loss,val/tau_prob\n0,999,,2.70\n0,1999,,3.00\n0,2000,2.0,\n0,2999,,3.10\n"
    )
    fake_run(tmp_path / "runs" / "single", rank=8)  # one val/loss point, no τ_prob curve
    runs = find_runs(str(tmp_path / "runs"))
    by_name = {r.path.name: r for r in runs}
    assert by_name["rising"].late_rise("val/tau_prob") == pytest.approx(0.10)
    assert by_name["rising"].late_rise("val/tau_prob", per=500) == pytest.approx(0.05)
    assert by_name["single"].late_rise("val/tau_prob") is None
    build_dashboard(runs, tmp_path / "out", title="t")
    table = (tmp_path / "out" / "tables" / "loss.md").read_text()
    assert "val/tau_prob rise /1k steps" in table
    (row,) = [line for line in table.splitlines() if "rank=64" in line]
    assert "| 0.100 |" in row


def test_report_publishes_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dspark.report import run_report

    for r in (8, 64):
        fake_run(tmp_path / "runs" / f"r{r}", rank=r)
    with initialize_config_module("dspark.conf", version_base="1.3"):
        cfg = compose(
            "report",
            overrides=[f"runs={tmp_path / 'runs'}", f"out_dir={tmp_path / 'out'}", "logger=tensorboard"],
        )
    index = run_report(cfg)
    assert index.is_file()
    acc = EventAccumulator(str(tmp_path / "out" / "tb"))
    acc.Reload()
    assert "report/sweep_axis" in acc.Tags()["images"] and "report/runs/text_summary" in acc.Tags()["tensors"]


def test_resumed_runs_stitch_their_logs(tmp_path):
    """A resumed run logs into logs/resumed-<step>/: one curve, the later part winning from its step;
    the same from a published copy, whose parts the GPU scripts' collect names metrics_logs.csv and
    metrics_resumed-<step>.csv at its top."""
    run = fake_run(tmp_path / "r", rank=8)
    (run / "logs" / "metrics.csv").write_text("epoch,step,train/loss\n0,0,3.0\n0,1,2.5\n0,2,9.9\n")
    (run / "logs" / "resumed-2").mkdir()
    (run / "logs" / "resumed-2" / "metrics.csv").write_text("epoch,step,train/loss\n0,2,2.2\n0,3,2.0\n")
    (curves,) = [r.curves for r in find_runs(str(run))]
    assert curves["train/loss"] == [(0, 3.0), (1, 2.5), (2, 2.2), (3, 2.0)]
    (run / "logs" / "metrics.csv").rename(run / "metrics_logs.csv")
    (run / "logs" / "resumed-2" / "metrics.csv").rename(run / "metrics_resumed-2.csv")
    shutil.rmtree(run / "logs")
    (published,) = [r.curves for r in find_runs(str(run))]
    assert published == curves
