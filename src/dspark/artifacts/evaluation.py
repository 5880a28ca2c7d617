"""An evaluation folder (python -m dspark.evaluate): ``results.json`` (τ per benchmark,
position-wise acceptance, macro averages), ``table.md``, ``rounds.jsonl`` (one engine RoundRecord
per request and round, with its benchmark), ``generations.jsonl``, ``meta.json`` (stamped:
provenance, timings, config), and with calibrate=true ``calibration.json`` (the STS temperatures
plus their metrics on the benchmark rounds). The figures sit beside them with their JSON."""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from ..core.errors import DataError
from ..core.io import atomic_open, atomic_write_text
from .drafter import CALIBRATION
from .folder import Folder


class EvaluationFolder(Folder):
    kind = "evaluation"
    RESULTS = "results.json"
    TABLE = "table.md"
    ROUNDS = "rounds.jsonl"
    GENERATIONS = "generations.jsonl"
    META = DESCRIPTOR = "meta.json"
    CALIBRATION = CALIBRATION
    # The figures, each with the JSON it plots beside it (same stem, .json).
    ACCEPTANCE_FIGURE = "acceptance_by_position.png"  # Fig. 2
    THRESHOLD_FIGURE = "threshold_sweep.png"  # Fig. 5, drafters with a confidence head
    RELIABILITY_FIGURE = "reliability.png"  # Fig. 6, with calibrate=true

    def exists(self) -> bool:
        return self.file(self.RESULTS).is_file()

    @property
    def rounds_path(self) -> Path:
        return self.file(self.ROUNDS)

    def write_results(self, results: dict) -> Path:
        return self.write_json(self.RESULTS, results)

    def read_results(self) -> dict:
        return self.read_json(self.RESULTS)

    def write_table(self, markdown: str) -> Path:
        return atomic_write_text(self.file(self.TABLE), markdown)

    def write_meta(self, meta: dict) -> Path:
        return self.write_json(self.META, meta)

    def read_meta(self) -> dict:
        return self.read_json(self.META, {})

    def write_calibration(self, report: dict) -> Path:
        """The temperatures (``method``, ``temperatures``: what Calibration.load reads) and their
        metrics."""
        return self.write_json(self.CALIBRATION, report)

    def read_calibration(self) -> dict | None:
        return self.read_json(self.CALIBRATION, None)

    def read_figure_data(self, figure: str) -> dict | None:
        """The JSON a figure of this folder was drawn from (None when the folder has none)."""
        return self.read_json(str(Path(figure).with_suffix(".json")), None)

    @contextlib.contextmanager
    def recorder(self) -> Iterator[tuple]:
        """``(rounds, generations)`` line writers (one dict a call); both files appear, atomically,
        only when the block completes."""
        with (
            atomic_open(self.rounds_path, "w", encoding="utf-8") as rf,
            atomic_open(self.file(self.GENERATIONS), "w", encoding="utf-8") as gf,
        ):
            yield _lines(rf), _lines(gf)


def _lines(f):
    def write(row: dict) -> None:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")

    return write


def read_rounds(path: str | Path) -> Iterator[dict]:
    """The records of a rounds.jsonl file (or its gzip, ``.gz``), one dict a line (DataError naming
    the line otherwise)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(_lines_of(f, path), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{n}: not JSON ({err.msg})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{n}: expected a JSON object per line")
            yield rec


def _lines_of(f, path: Path) -> Iterator[str]:
    try:
        yield from f
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text: not a rounds.jsonl this pipeline wrote") from None
