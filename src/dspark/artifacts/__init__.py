"""The folders the stages hand each other, each typed once: its file names, how each file is read
and (atomically) written, and a schema version. Nothing else in dspark spells these file names.

  DrafterFolder     config.json, model.safetensors, calibration.json, calibration_report.json
  RunFolder         config.yaml, summary.json, drafter/, checkpoints/, logs/ | tb/, report/
  EvaluationFolder  results.json, table.md, rounds.jsonl, generations.jsonl, meta.json, calibration.json,
                    the figures (acceptance_by_position, threshold_sweep, reliability: .png + .json)
  FrontierFolder    frontier.json, cost_table.json, meta.json
"""

from .drafter import DrafterFolder, load_calibration
from .evaluation import EvaluationFolder, read_rounds
from .frontier import FrontierFolder
from .run import RunFolder
from .schema import SCHEMA_VERSION

__all__ = [
    "SCHEMA_VERSION",
    "DrafterFolder",
    "EvaluationFolder",
    "FrontierFolder",
    "RunFolder",
    "load_calibration",
    "read_rounds",
]
