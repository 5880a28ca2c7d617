"""Other projects' drafter layouts: the serving engines' (vLLM, SGLang) and DeepSpec's checkpoint
formats, their key names and config fields (formats), and the translation of a DeepSpec-format
DSpark/DFlash folder into our schema (deepspec). Reading and writing folders: dspark.checkpoints."""

from .deepspec import is_foreign, translate
from .formats import FORMATS, ExportError, InteropError

__all__ = ["FORMATS", "ExportError", "InteropError", "is_foreign", "translate"]
