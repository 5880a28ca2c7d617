"""Helpers of the data pipeline: where a configured input path points, text normalisation, stable
hashes. (Atomic writes and JSON reading are everyone's: ``dspark.core.io``.)"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
from pathlib import Path
from typing import Any

from ..core.errors import DataError
from ..core.provenance import checkout_root

# `pkg://<package>/<path>` names a file or folder shipped inside an installed package.
PACKAGE_SCHEME = "pkg://"


def normalize_text(text: str) -> str:
    """Whitespace-normalised text: the key for de-duplication and benchmark decontamination."""
    return " ".join(str(text).split())


def stable_hash(obj: Any, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def packaged_path(spec: str) -> Path:
    """The file or folder `pkg://<package>/<path>` names, found through importlib.resources so that a
    wheel install finds its data as well as a checkout does."""
    package, _, inner = spec.removeprefix(PACKAGE_SCHEME).partition("/")
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        raise DataError(f"'{spec}': no installed package '{package}' (pkg://<package>/<path>)") from None
    return Path(root.joinpath(*inner.split("/"))) if inner else Path(root)


def resolve_path(path: str | Path, must_exist: bool = False) -> Path:
    """`pkg://<package>/<path>` means a packaged file; other relative paths mean the working directory
    when they exist there, else the source checkout when dspark runs from one (so the configs'
    relative folders work from any directory of an editable install)."""
    if str(path).startswith(PACKAGE_SCHEME):
        p = packaged_path(str(path))
        if must_exist and not p.exists():
            raise DataError(f"path '{path}' is not in the installed package (looked at {p})")
        return p
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
