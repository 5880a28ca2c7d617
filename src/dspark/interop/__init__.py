"""Interoperability with the serving engines and DeepSpec: export our drafters in the layouts vLLM,
SGLang and DeepSpec load, and import DeepSpec-format DSpark/DFlash checkpoints (docs/formats.md)."""

from .deepspec import is_foreign, translate
from .export import export_drafter, refusal
from .formats import FORMATS, ExportError, InteropError

__all__ = ["FORMATS", "ExportError", "InteropError", "export_drafter", "is_foreign", "refusal", "translate"]
