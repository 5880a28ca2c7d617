"""Named phases of the training step, as torch.profiler ranges (``bench.step_profile`` reads them).

``phase("loss")`` is a ``record_function`` range named ``dspark:loss`` while a profiler records and
a no-op otherwise: the step opens about twenty per optimizer step, and an idle range still costs
a dispatcher call each, so without a profiler only a flag is read. Phases nest (the profile reads
the nesting from the times); a phase's name says what it does, not where it sits.
"""

from __future__ import annotations

import contextlib

import torch

PREFIX = "dspark:"
STEP = PREFIX + "step#"  # one optimizer step of a profile window: "dspark:step#<global step>"


def recording() -> bool:
    """Whether a profiler records now (the autograd profiler's own flag: no dispatch)."""
    return torch.autograd._profiler_enabled()


def phase(name: str):
    """A profiler range ``dspark:<name>`` around the block while a profiler records, else nothing."""
    if recording():
        return torch.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()
