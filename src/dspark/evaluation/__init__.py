"""The library of python -m dspark.evaluate: speculative decoding of benchmark prompts with a saved
drafter, measured (τ per benchmark, position-wise acceptance, the threshold sweep) and, with
calibrate=true, STS fitted on held-out prompts first.

  checks     the config against the checkpoint's spec, before any model loads
  prompts    which prompts are reported and which are held out for calibration
  evaluator  the engines: the calibration rollouts and the benchmark rollouts
  outputs    results.json, table.md, the figures, calibration.json (an EvaluationFolder)
"""

from .checks import check_config
from .evaluator import Evaluator
from .outputs import macro, macro_stderr, write_outputs
from .prompts import split_prompts

__all__ = ["Evaluator", "check_config", "macro", "macro_stderr", "split_prompts", "write_outputs"]
