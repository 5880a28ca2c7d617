"""Evaluation folders named on the command line for the paper's table and figures, each with the
row label it gets: ``label:folder`` (e.g. ``DFlash:outputs/h200/eval_dflash_t0``), or a bare
folder (or glob), labelled with the drafter its results.json names. Every mistake is a DataError
that names the folder and the fix."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..artifacts import EvaluationFolder
from ..core.errors import DataError
from .runs import Evaluation, read_evaluation

__all__ = ["LABEL", "Labelled", "evaluation_gamma", "parse_source", "read_labelled"]

# A label becomes a table row and part of figure file names: no spaces, slashes or colons.
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_REQUIRED = ("target", "temperature", "benchmarks")


@dataclass
class Labelled:
    label: str
    evaluation: Evaluation

    @property
    def results(self) -> dict:
        return self.evaluation.results

    @property
    def path(self) -> Path:
        return self.evaluation.path

    @property
    def temperature(self) -> float:
        return float(self.results["temperature"])

    @property
    def gamma(self) -> int | None:
        return evaluation_gamma(self.results)


def evaluation_gamma(results: dict) -> int | None:
    """The block each round verified: results.json's ``gamma``; in folders written before it was
    recorded, the policy's fixed γ, else the length of the position-wise acceptance (= the
    drafter's γ)."""
    if results.get("gamma") is not None:
        return int(results["gamma"])
    policy = results.get("policy")
    if isinstance(policy, dict) and policy.get("gamma") is not None:
        return int(policy["gamma"])
    lengths = {len(b.get("accept_rate_by_position") or []) for b in results["benchmarks"].values()}
    return lengths.pop() if len(lengths) == 1 and 0 not in lengths else None


def parse_source(text: str) -> tuple[str | None, str]:
    """``label:folder`` -> (label, folder); a bare folder -> (None, folder)."""
    head, sep, tail = text.partition(":")
    if sep and tail and LABEL.fullmatch(head):
        return head, tail
    return None, text


def _folders(label: str | None, pattern: str) -> list[Path]:
    pattern = os.path.expanduser(pattern)
    if not glob.has_magic(pattern):
        return [Path(pattern)]
    if label is not None:
        raise DataError(f"runs: {label}:{pattern} labels a glob; a label names one evaluation folder")
    found = [Path(m) for m in sorted(glob.glob(pattern)) if EvaluationFolder(m).exists()]
    if not found:
        raise DataError(f"runs: {pattern} matches no evaluation folder (one with results.json)")
    return found


def _read(label: str | None, folder: Path) -> Labelled:
    if not folder.is_dir():
        raise DataError(
            f"runs: no evaluation folder {folder}: pass the out_dir (hydra.run.dir) that python -m "
            f"dspark.evaluate wrote, as label:folder or folder"
        )
    if not EvaluationFolder(folder).exists():
        raise DataError(
            f"runs: {folder} has no {EvaluationFolder.RESULTS}: not a finished evaluation (an "
            f"interrupted one writes none); evaluate again into it"
        )
    ev = read_evaluation(folder)
    missing = [k for k in _REQUIRED if k not in ev.results]
    if missing:
        where = folder / EvaluationFolder.RESULTS
        raise DataError(f"{where} lacks {', '.join(missing)}: not the results of python -m dspark.evaluate")
    name = label if label is not None else str(ev.results.get("drafter") or folder.name)
    if not LABEL.fullmatch(name):
        raise DataError(f"{folder}: drafter name {name!r} is not a usable label: name it, label:{folder}")
    return Labelled(name, ev)


def read_labelled(sources: Sequence[str]) -> list[Labelled]:
    """The evaluations of ``sources`` (``label:folder``, folders or globs), in the order given."""
    if not sources:
        raise DataError("runs is empty: name the evaluation folders, runs=[DFlash:<folder>,DSpark:<folder>]")
    out = []
    for source in sources:
        label, pattern = parse_source(str(source))
        out += [_read(label, folder) for folder in _folders(label, pattern)]
    return out
