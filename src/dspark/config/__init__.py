"""Every entry point's config checked in one pass before any model loads or file is written: each
command's keys as a schema (dspark.core.schema, built from the schemas of the units that own the
groups), unknown keys refused, then the rules across keys and against the drafter checkpoint.
Mistakes are ConfigErrors naming the key and the fix."""

from .apps import check_evaluate, check_export, check_report, check_schedule
from .train import check_drafter, check_prepare, check_target, check_train

__all__ = [
    "check_drafter",
    "check_evaluate",
    "check_export",
    "check_prepare",
    "check_report",
    "check_schedule",
    "check_target",
    "check_train",
]
