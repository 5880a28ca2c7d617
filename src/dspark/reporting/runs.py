"""Training runs and evaluation folders read back from disk, and the sweep axis found among them.

Everything here works offline from the folders the pipeline writes (dspark.artifacts): a run's
config, summary, logged curves (logs/metrics.csv, a published copy's metrics*.csv, or tb/ event
files) and validation calibration report; an evaluation's results, calibration and meta (whose
`drafter_dir` links it to a run).
"""

from __future__ import annotations

import csv
import glob
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..artifacts import DrafterFolder, EvaluationFolder, RunFolder
from ..core.errors import ConfigError, UserError

log = logging.getLogger(__name__)

__all__ = ["AxisError", "Evaluation", "Run", "find_runs", "flatten", "SweepAxis", "sweep_axis"]

# Folders inside a run that never hold runs or evaluations: not worth walking.
_SKIP_DIRS = {
    ".hydra",
    "checkpoints",
    "drafter",
    "logs",
    "tb",
    "wandb",
    "figures",
    "tables",
    "report",
    "__pycache__",
}
_MAX_DEPTH = 6  # multirun job folders nest when an override value holds a path


def _finite(v) -> float | None:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": leaf}; lists stay leaves (as tuples, so they compare and hash)."""
    out: dict[str, Any] = {}
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(cfg, (list, tuple)):
        out[prefix[:-1]] = tuple(cfg)
    else:
        out[prefix[:-1]] = cfg
    return out


@dataclass
class Evaluation:
    path: Path
    results: dict
    calibration: dict | None = None
    meta: dict = field(default_factory=dict)

    @property
    def tag(self) -> str:
        """What distinguishes two evaluations of one drafter: policy, γ and temperature."""
        pol = self.results.get("policy") or {}
        name = pol.get("name", "?") if isinstance(pol, dict) else str(pol)
        gamma = pol.get("gamma") if isinstance(pol, dict) else None
        g = f" γ={gamma}" if gamma is not None else ""
        return f"{name}{g} T={self.results.get('temperature')}"

    def drafter_dir(self) -> Path | None:
        d = self.meta.get("drafter_dir")
        if not d:
            return None
        p = Path(d)
        return (p if p.is_absolute() else Path.cwd() / p).resolve()


@dataclass
class Run:
    path: Path
    config: dict
    summary: dict = field(default_factory=dict)
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    calibration: dict | None = None  # drafter/calibration_report.json (validation, fitted in training)
    evaluations: list[Evaluation] = field(default_factory=list)
    label: str = ""

    @property
    def flat(self) -> dict[str, Any]:
        flat = flatten(self.config)
        if flat.get("head.name") == "none" and "head.rank" in flat:
            # No head has rank 0 whatever the config carries (an experiment preset may set head.rank
            # for every head; the drafter ignores it without a head): rank sweeps put it at r = 0.
            flat["head.rank"] = 0
        return flat

    @property
    def name(self) -> str:
        return str(self.config.get("run_name") or self.summary.get("run_name") or self.path.name)

    def final(self, key: str) -> float | None:
        """The metric at the end of training: summary.json, else the last logged value."""
        v = _finite((self.summary.get("final") or {}).get(key))
        if v is None and self.curves.get(key):
            v = _finite(self.curves[key][-1][1])
        return v

    def late_rise(self, key: str, per: int = 1000) -> float | None:
        """How fast the metric still moved at the end of training: its change between the last two
        logged points, per ``per`` steps (None with fewer than two). Near zero for a run that has
        converged; a run compared "at convergence" shows it here rather than by assertion."""
        pts = [(s, v) for s, v in self.curves.get(key) or [] if _finite(v) is not None]
        if len(pts) < 2 or pts[-1][0] == pts[-2][0]:
            return None
        (s0, v0), (s1, v1) = pts[-2], pts[-1]
        return (v1 - v0) * per / (s1 - s0)

    def calibration_summary(self) -> dict | None:
        """Per-position ECE raw / after STS: from an evaluation when there is one (measured on real
        decoding rounds), else the validation report written at training time."""
        for ev in self.evaluations:
            if ev.calibration and ev.calibration.get("per_position"):
                return {**ev.calibration, "source": f"evaluation ({ev.path.name})"}
        if self.calibration and self.calibration.get("per_position"):
            return {**self.calibration, "source": "validation (training)"}
        return None


# ----------------------------------------------------------------------------------------------
# reading


def _is_run_dir(d: Path) -> bool:
    return RunFolder(d).is_run()


def _is_eval_dir(d: Path) -> bool:
    return EvaluationFolder(d).exists()


def _csv_curves(path: Path) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list[tuple[int, float]]] = {}
    if not path.is_file():
        return curves
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if not step:
                continue
            for key, value in row.items():
                v = _finite(value) if key not in ("step", "epoch") else None
                if v is not None:
                    curves.setdefault(key, []).append((int(float(step)), v))
    return curves


def _tb_curves(folder: Path) -> dict[str, list[tuple[int, float]]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        tag: [(int(e.step), float(e.value)) for e in acc.Scalars(tag) if math.isfinite(e.value)]
        for tag in acc.Tags().get("scalars", [])
    }


def _parts(root: Path, marker: str) -> list[tuple[int, Path]]:
    """(first step, folder) of a run's logging parts: the first run, then `resumed-<step>/`."""
    parts = [(0, root)] if (root / marker).exists() or any(root.glob(marker)) else []
    for d in root.glob("resumed-*"):
        if d.is_dir() and d.name[8:].isdigit():
            parts.append((int(d.name[8:]), d))
    return sorted(parts)


def _published_parts(run_dir: Path) -> list[tuple[int, Path]]:
    """A published copy's CSV parts at its top: metrics.csv, or what the GPU scripts' collect names
    them, metrics_logs.csv and metrics_resumed-<step>.csv."""
    first = next((f for f in (run_dir / "metrics.csv", run_dir / "metrics_logs.csv") if f.is_file()), None)
    parts = [(0, first)] if first else []
    for f in run_dir.glob("metrics_resumed-*.csv"):
        step = f.stem.removeprefix("metrics_resumed-")
        if step.isdigit():
            parts.append((int(step), f))
    return sorted(parts)


def read_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] from the CSV logger, else TensorBoard event files (when installed).
    A resumed run logs each part into `resumed-<step>/`; the parts are stitched, a later part
    winning over steps an earlier one logged after its last checkpoint. W&B offline runs keep their
    history in a binary file: log with csv too to get curves here."""
    run = RunFolder(run_dir)
    parts = [(step, folder / "metrics.csv") for step, folder in _parts(run.logs, "metrics.csv")]
    parts, read = parts or _published_parts(run_dir), _csv_curves
    if not parts and run.tensorboard.is_dir():
        parts, read = _parts(run.tensorboard, "events.out.tfevents.*"), _tb_curves
    curves: dict[str, list[tuple[int, float]]] = {}
    for i, (_, folder) in enumerate(parts):
        stop = parts[i + 1][0] if i + 1 < len(parts) else math.inf
        for key, pts in read(folder).items():
            curves.setdefault(key, []).extend(p for p in pts if p[0] < stop)
    return curves


def read_evaluation(d: Path) -> Evaluation:
    f = EvaluationFolder(d)
    return Evaluation(path=d, results=f.read_results(), calibration=f.read_calibration(), meta=f.read_meta())


def _results_below(d: Path) -> list[Path]:
    """results.json files one or two folders below ``d``."""
    name = EvaluationFolder.RESULTS
    return sorted(d.glob(f"*/{name}")) + sorted(d.glob(f"*/*/{name}"))


def read_run(d: Path) -> Run:
    folder = RunFolder(d)
    run = Run(
        path=d,
        config=folder.read_config(),
        summary=folder.read_summary(),
        curves=read_curves(d),
        calibration=folder.drafter.read_calibration_report(),
    )
    # Evaluations written inside the run folder (e.g. hydra.run.dir=<run>/eval).
    for res in _results_below(d):
        inside = set(res.relative_to(d).parts[:-1]) & _SKIP_DIRS
        if not inside and (ev := _readable(read_evaluation, res.parent)) is not None:
            run.evaluations.append(ev)
    return run


def _run_from_evaluation(ev: Evaluation) -> Run:
    """A run for an evaluation folder given on its own: its training run when the drafter folder
    still sits in one, else the drafter's config.json, else only what results.json says."""
    ddir = ev.drafter_dir()
    if ddir is not None and _is_run_dir(ddir.parent):
        return read_run(ddir.parent)
    config: dict = {
        "drafter": {"name": ev.results.get("drafter")},
        "target": {"name": ev.results.get("target")},
    }
    if ddir is not None and DrafterFolder(ddir).exists():
        dc = DrafterFolder(ddir).read_config()
        config = {k: dc[k] for k in ("drafter", "head", "target") if k in dc}
        config["target"] = {"name": (dc.get("target") or {}).get("name")}
        config["run_name"] = ev.results.get("drafter")
    # Keyed by the drafter folder, so several evaluations of one drafter make one run.
    return Run(path=ddir if ddir is not None else ev.path, config=config)


def _walk(d: Path, depth: int, runs: list[Path], evals: list[Path]) -> None:
    if _is_run_dir(d):
        runs.append(d)
    elif _is_eval_dir(d):
        evals.append(d)
    elif depth < _MAX_DEPTH:
        for child in sorted(p for p in d.iterdir() if p.is_dir() and p.name not in _SKIP_DIRS):
            _walk(child, depth + 1, runs, evals)


def _readable(read, d: Path):
    """``read(d)``, or None with a warning when the folder cannot be read (a corrupt or half-copied
    file): one broken run does not take the whole dashboard down."""
    try:
        return read(d)
    except (UserError, OSError, ValueError, csv.Error) as err:
        log.warning("skipping %s: %s", d, " ".join(str(err).split()))
        return None


def _patterns(spec: str | Sequence[str]) -> list[str]:
    if isinstance(spec, str):
        return [spec]  # one pattern: Hydra multirun folder names contain commas
    return [str(s) for s in spec]


def find_runs(spec: str | Sequence[str] | Iterable[str]) -> list[Run]:
    """Runs named by a folder or glob, or a list of them. A folder may be a run,
    an evaluation, or any folder above them (a Hydra multirun dir, outputs/train). Evaluation folders
    join the run whose drafter they evaluated, whether they sit inside it, next to it, or elsewhere."""
    run_dirs: list[Path] = []
    eval_dirs: list[Path] = []
    for pat in _patterns(spec):
        pat = os.path.expanduser(pat)
        matches = sorted(glob.glob(pat)) if glob.has_magic(pat) else [pat]
        if not glob.has_magic(pat) and not Path(pat).exists():
            raise FileNotFoundError(f"runs: no such folder {pat}")
        for m in matches:
            if Path(m).is_dir():
                _walk(Path(m).resolve(), 0, run_dirs, eval_dirs)

    runs: dict[Path, Run] = {}
    for d in dict.fromkeys(run_dirs):
        if (run := _readable(read_run, d)) is not None:
            runs[d] = run
    # Evaluations next to a run (in its parent folder or one level below) join it when they point
    # at its drafter; unlike the folders named in `spec`, a stray neighbour never becomes a run.
    neighbours: list[Path] = []
    for d in list(runs):
        for res in _results_below(d.parent):
            if d not in res.parents and res.parent not in eval_dirs:
                neighbours.append(res.parent)
    for d in dict.fromkeys([*eval_dirs, *neighbours]):
        if any(d == r or r in d.parents for r in runs):
            continue  # inside a run: read_run has it
        ev = _readable(read_evaluation, d)
        if ev is None:
            continue
        ddir = ev.drafter_dir()
        owner = ddir.parent if ddir is not None else None
        if owner is not None and owner not in runs and not ddir.exists():
            # A copy published elsewhere (docs/results): the drafter folder it names is gone, and
            # the run whose folder bears that run's name, if just one does, is the one it evaluated.
            # A neighbour looks only beside itself: a rerun of the same name in another session's
            # folder must not collect the earlier run's evaluations.
            same = [r for r in runs if r.name == owner.name and (d in eval_dirs or r.parent in d.parents)]
            owner = same[0] if len(same) == 1 else owner
        if owner in runs:
            runs[owner].evaluations.append(ev)
        elif d in eval_dirs:
            run = _run_from_evaluation(ev)
            key = run.path.resolve()
            run = runs.setdefault(key, run)
            if all(e.path != ev.path for e in run.evaluations):
                run.evaluations.append(ev)
    return list(runs.values())


# ----------------------------------------------------------------------------------------------
# the sweep axis

# Keys that differ between runs without being an experimental choice.
_IGNORE_PREFIXES = ("hydra.", "logger.", "callbacks.", "dims.")
_IGNORE_KEYS = {"out_dir", "run_name", "resume", "global_step", "target.fingerprint", "data.num_workers"}
_IGNORE_SUFFIXES = ("_dir", ".dir", ".path", "cache_dir", "progress")
# Preferred axes and series labels, most telling first (ties in the number of distinct values).
PRIORITY = (
    "head.rank",
    "drafter.block_size",
    "drafter.num_layers",
    "head.name",
    "drafter.name",
    "target.name",
    "loss.tv",
    "loss.ce",
    "loss.kl",
    "seed",
)
# Series labels read best as "dflash" / "dspark rnn": the drafter, then its head.
SERIES_FIRST = ("drafter.name", "head.name", "target.name")
# Natural order of categorical values (weakest to strongest sequential modelling).
CATEGORY_ORDER = {
    "head.name": ("none", "markov", "gated", "rnn"),
    "drafter.name": ("eagle3", "dflash", "dspark"),
}


def _ignored(key: str) -> bool:
    return key in _IGNORE_KEYS or key.startswith(_IGNORE_PREFIXES) or key.endswith(_IGNORE_SUFFIXES)


def _prio(key: str) -> int:
    return PRIORITY.index(key) if key in PRIORITY else len(PRIORITY)


def _determined(key: str, by: Sequence[str], flats: Sequence[dict]) -> bool:
    """True when `key`'s value is a function of the values of `by` across these runs."""
    seen: dict[tuple, Any] = {}
    for f in flats:
        k = tuple(repr(f.get(b)) for b in by)
        if seen.setdefault(k, repr(f.get(key))) != repr(f.get(key)):
            return False
    return True


def is_numeric(values: Iterable[Any]) -> bool:
    vals = list(values)
    return bool(vals) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)


class AxisError(ConfigError):
    """axis=<key> names a key that not every run's config has."""


@dataclass
class SweepAxis:
    key: str | None  # config key on the x-axis (None: nothing differs)
    series: list[str]  # further keys that split runs into lines
    differing: list[str]  # every experimental key that differs
    names: list[str] = field(default_factory=list)  # a name axis' labels: the names it determines
    # the series' names and those they determine ("dspark markov", not "dspark", beside "dflash none")
    series_names: list[str] = field(default_factory=list)

    def value(self, run: Run) -> Any:
        return run.flat.get(self.key) if self.key else None

    def series_label(self, run: Run, with_axis_names: bool = False) -> str:
        """The run's series: its names ("dflash none"), then its numbers with their keys ("rank=64").
        ``with_axis_names``: a name axis' own names join them in the usual order, drafter before head
        (a Table 1 comparison's axis is the head: "dflash none", not "none dflash")."""
        f = run.flat  # names speak for themselves ("dflash"); numbers need their key ("rank=64")
        names = self.series_names + [k for k in self.series if k.endswith(".name")]
        if with_axis_names:
            names = [*(self.names or [self.key]), *names]
            names.sort(key=lambda k: SERIES_FIRST.index(k) if k in SERIES_FIRST else len(SERIES_FIRST))
        names = list(dict.fromkeys(names))  # each once: drafter, head, target, then any other
        numbers = [f"{k.split('.')[-1]}={f.get(k)}" for k in self.series if not k.endswith(".name")]
        return " ".join([*(str(f.get(k)) for k in names), *numbers])

    def order(self, runs: Sequence[Run]) -> list[Run]:
        """Runs sorted along the axis (numbers ascending, known categories in their natural order)."""
        if not self.key:
            return sorted(runs, key=lambda r: r.name)
        vals = [self.value(r) for r in runs]
        if is_numeric(vals):
            return sorted(runs, key=lambda r: (self.series_label(r), self.value(r)))
        known = CATEGORY_ORDER.get(self.key, ())
        rank = {v: i for i, v in enumerate(known)}
        return sorted(
            runs, key=lambda r: (rank.get(self.value(r), len(rank)), str(self.value(r)), self.series_label(r))
        )


def sweep_axis(runs: Sequence[Run], prefer: str | None = None) -> SweepAxis:
    """The config key that varies across runs, and the keys that split runs into lines.

    Keys that determine each other (drafter=dflash brings head none, rank 0 and its loss weights)
    form one factor. The axis is the factor with the most levels (a rank sweep also flips head.name
    between none and markov, but the rank has more levels and explains it); on a tie, a knob swept on
    its own beats a bundle of co-varying keys (block size over drafter in a DFlash-vs-DSpark
    comparison). A factor of co-varying keys is named by its name keys, and a name axis labels runs
    by every name it determines (a DFlash vs DSpark-Gated comparison reads "dflash none" / "dspark
    gated", not "rank=0" / "rank=256"). Keys the
    axis does not explain become series, names first; keys explained by the axis and the series
    already kept are dropped."""
    flats = [r.flat for r in runs]
    if not flats:
        return SweepAxis(None, [], [])
    common = set(flats[0]).intersection(*flats[1:])
    differing = sorted(
        (k for k in common if not _ignored(k) and len({repr(f[k]) for f in flats}) > 1),
        key=lambda k: (_prio(k), k),
    )
    if prefer:
        if prefer not in common:
            raise AxisError(
                f"axis={prefer}: no such config key in every run (have e.g. {sorted(common)[:8]})"
            )
        key = prefer
    elif differing:

        def levels(k: str) -> int:
            return len({repr(f[k]) for f in flats})

        def factor_size(k: str) -> int:
            return sum(_determined(k, [o], flats) and _determined(o, [k], flats) for o in differing)

        key = max(differing, key=lambda k: (levels(k), -factor_size(k), -_prio(k)))
    else:
        return SweepAxis(None, [], [])
    if not prefer:  # the axis' factor (the keys it and they determine each other) by its name
        factor = [k for k in differing if _determined(k, [key], flats) and _determined(key, [k], flats)]
        key = next((k for k in SERIES_FIRST if k in factor), key)
    names: list[str] = []
    if key in SERIES_FIRST:  # a name axis: labelled by every name it determines ("dspark gated")
        names = [k for k in SERIES_FIRST if k in differing and _determined(k, [key], flats)]
    series: list[str] = []
    for k in sorted(
        differing, key=lambda k: (SERIES_FIRST.index(k) if k in SERIES_FIRST else 9, _prio(k), k)
    ):
        if k != key and not _determined(k, [key, *series], flats):
            series.append(k)
    named = [k for k in series if k in SERIES_FIRST]
    series_names = [
        k
        for k in SERIES_FIRST
        if k in differing
        and k != key
        and (k in named or (named and _determined(k, named, flats) and not _determined(k, [key], flats)))
    ]
    return SweepAxis(key, series, differing, names, series_names)


def label_runs(runs: Sequence[Run], axis: SweepAxis) -> None:
    """Short, unique labels: the axis value (and series) when there is an axis, else the run name."""
    for r in runs:
        if axis.key in SERIES_FIRST:  # a name axis: its names and the series', drafter first
            r.label = axis.series_label(r, with_axis_names=True)
        elif axis.key:  # a number axis: "rank=64", then the series
            head = f"{axis.key.split('.')[-1]}={axis.value(r)}"
            r.label = " ".join([head, axis.series_label(r)] if axis.series else [head])
        else:
            r.label = r.name
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.label] = counts.get(r.label, 0) + 1
    seen: dict[str, int] = {}
    for r in runs:
        if counts[r.label] > 1:  # repeated settings (e.g. seeds not varied): tell them apart by folder
            seen[r.label] = seen.get(r.label, 0) + 1
            r.label = f"{r.label} #{seen[r.label]}"
