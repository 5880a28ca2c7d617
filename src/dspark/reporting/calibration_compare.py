"""Which calibration suits a drafter: STS against STS with offsets on recorded benchmark rounds.

    python -m dspark.reporting.calibration_compare <evaluation folder | rounds.jsonl[.gz]> … [--folds 2] \\
        [--n-bins 15] [--out calibration_compare.json]

The rounds of a fixed-block evaluation (``python -m dspark.evaluate policy.gamma=null``) are split by
request into ``folds`` parts; each method is fitted on all parts but one and scored on that one, so
every number is held out, and prompts never straddle the fit and the score (rounds of one prompt
are alike). Per draft position and method: the ECE of the prefix-survival probability a_k, its
noise floor (``calibration.metrics.ece_noise_floor``: what perfect calibration would show on as
many rounds), and the AUROC, each the mean over the folds; plus each method's fitted parameters per
fold. The JSON holds the command, commit, machine and date, and ``sources``: each input's result.
"""

from __future__ import annotations

import argparse
import logging
import zlib
from pathlib import Path

from ..artifacts import EvaluationFolder
from ..artifacts.evaluation import read_rounds
from ..calibration.metrics import position_metrics
from ..calibration.sts import Calibration
from ..core.errors import ConfigError, DataError
from ..core.io import atomic_write_json
from ..core.provenance import provenance
from ..decoding.engine import calibration_arrays

log = logging.getLogger(__name__)

METHODS = ("raw", "sts", "sts_offsets")
_SCORES = {
    "ece": ("ece_raw", "ece_sts"),
    "ece_floor": ("ece_raw_floor", "ece_sts_floor"),
    "auroc": ("auroc", "auroc_sts"),
}


def fold_of(request: str, folds: int) -> int:
    """A request's fold: a stable hash of its id, so a rerun splits alike."""
    return zlib.crc32(str(request).encode()) % folds


def compare(records: list[dict], folds: int = 2, n_bins: int = 15) -> dict:
    """Held-out metrics per method and position over ``folds`` folds of ``records`` (see the module
    docstring): ``{"rounds", "folds", "methods": {method: {"ece", "ece_floor", "auroc": [per
    position], "ece_mean", "ece_max", "ece_floor_mean"}}, "fits": {method: [Calibration dicts]}}``."""
    if folds < 2:
        raise ConfigError(f"--folds {folds}: need at least 2, to score each method where it was not fitted")
    parts = [[r for r in records if fold_of(r["request"], folds) == f] for f in range(folds)]
    if any(not p for p in parts):
        raise DataError(f"{len(records)} rounds do not fill {folds} folds of requests: use fewer folds")
    scores = {m: {key: [] for key in _SCORES} for m in METHODS}
    fits: dict[str, list[dict]] = {m: [] for m in METHODS[1:]}
    for f, held in enumerate(parts):
        fit = calibration_arrays([r for g, p in enumerate(parts) if g != f for r in p])
        z, y, valid = calibration_arrays(held)
        for method in METHODS:
            cal = None if method == "raw" else Calibration.fit(*fit, offsets=method == "sts_offsets")
            rows = position_metrics(z, y, valid, cal, n_bins)
            for key, (raw_key, cal_key) in _SCORES.items():
                scores[method][key].append([r.get(raw_key if cal is None else cal_key) for r in rows])
            if cal is not None:
                fits[method].append(cal.to_dict())
    out = {"rounds": len(records), "folds": folds, "methods": {}, "fits": fits}
    for method, by_key in scores.items():
        mean = {key: [sum(v) / len(v) for v in zip(*per_fold)] for key, per_fold in by_key.items()}
        mean["ece_mean"] = sum(mean["ece"]) / len(mean["ece"])
        mean["ece_max"] = max(mean["ece"])
        mean["ece_floor_mean"] = sum(mean["ece_floor"]) / len(mean["ece_floor"])
        out["methods"][method] = mean
    return out


def _records(source: str) -> list[dict]:
    path = Path(source)
    if path.is_dir():
        path = EvaluationFolder(path).rounds_path
    if not path.is_file():
        raise DataError(f"{source}: no rounds file there (python -m dspark.evaluate writes rounds.jsonl)")
    return list(read_rounds(path))


def _print(source: str, res: dict) -> None:
    print(
        f"\n{source}: {res['rounds']} rounds, {res['folds']} folds by request; ECE % per position (held out)"
    )
    for method, m in res["methods"].items():
        ece = " ".join(f"{100 * e:5.2f}" for e in m["ece"])
        print(f"  {method:12s} {ece} | mean {100 * m['ece_mean']:.2f}, max {100 * m['ece_max']:.2f}, "
              f"floor {100 * m['ece_floor_mean']:.2f}")  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m dspark.reporting.calibration_compare", description=__doc__.split("\n")[0]
    )
    ap.add_argument("rounds", nargs="+", help="evaluation folders or rounds.jsonl(.gz) files")
    ap.add_argument("--folds", type=int, default=2)
    ap.add_argument("--n-bins", type=int, default=15)
    ap.add_argument("--out", default="calibration_compare.json")
    args = ap.parse_args(argv)
    report = {**provenance("dspark.reporting.calibration_compare", argv), "sources": {}}
    for source in args.rounds:
        try:
            report["sources"][source] = compare(_records(source), args.folds, args.n_bins)
        except ValueError as err:  # rounds without confidence logits: a drafter without the head
            raise DataError(f"{source}: {err}") from None
        _print(source, report["sources"][source])
    atomic_write_json(args.out, report)
    return report


if __name__ == "__main__":
    from ..cli import user_errors

    logging.basicConfig(level=logging.INFO)
    with user_errors():
        main()
