"""Helpers of the data pipeline: where a configured input path points, text normalisation, stable
hashes. (Atomic writes and JSON reading are everyone's: ``dspark.core.io``.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..core.errors import DataError
from ..core.provenance import checkout_root


def normalize_text(text: str) -> str:
    """Whitespace-normalised text: the key for de-duplication and benchmark decontamination."""
    return " ".join(str(text).split())


def stable_hash(obj: Any, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def resolve_path(path: str | Path, must_exist: bool = False) -> Path:
    """Relative paths mean the working directory when they exist there, else the source checkout
    when dspark runs from one (so the configs' relative folders work from any directory of an
    editable install)."""
    p = Path(str(path)).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve() if p.exists() else p
    root = checkout_root()
    if root is not None and (root / p).exists():
        return (root / p).resolve()
    if must_exist:
        places = " and ".join(str(d) for d in (Path.cwd(), root) if d is not None)
        raise DataError(f"path '{path}' does not exist (looked under {places})")
    return p
