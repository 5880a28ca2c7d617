"""Small I/O helpers shared by the data pipeline: atomic writes, JSONL, paths, text normalisation."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

# src/dspark/data/io.py -> the repository root (meaningful for an editable install / a checkout).
PROJECT_ROOT = Path(__file__).resolve().parents[3]
# `pkg://<package>/<path>` names a file or folder shipped inside an installed package.
PACKAGE_SCHEME = "pkg://"


class DataError(ValueError):
    """Bad data or a data config that cannot work; the message names the key or file to fix."""


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kw) -> Iterator[Any]:
    """Write to a temp file beside `path` and rename it into place only when the block succeeds, so
    a crash or a full disk never leaves a half-written file under the final name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def finite(x: Any) -> Any:
    """``x`` with NaN and ±inf floats replaced by None, recursively: strict JSON has neither."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def atomic_write_json(path: str | Path, obj: Any) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, default=str)
        f.write("\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def atomic_save_safetensors(path: str | Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save

    blob = save(tensors, metadata=metadata)
    with atomic_open(path, "wb") as f:
        f.write(blob)


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_jsonl(path: str | Path) -> list[dict]:
    """Strict reader for files this pipeline wrote itself (user files: prompts.read_prompt_jsonl)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


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
    when they exist there, else the project root (so `data/...` works from any directory of a
    checkout)."""
    if str(path).startswith(PACKAGE_SCHEME):
        p = packaged_path(str(path))
        if must_exist and not p.exists():
            raise DataError(f"path '{path}' is not in the installed package (looked at {p})")
        return p
    p = Path(str(path)).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve() if p.exists() else p
    rooted = PROJECT_ROOT / p
    if rooted.exists():
        return rooted.resolve()
    if must_exist:
        raise DataError(f"path '{path}' exists neither under {Path.cwd()} nor under {PROJECT_ROOT}")
    return p
