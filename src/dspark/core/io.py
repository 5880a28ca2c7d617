"""Atomic file writes and JSON reading: a crash or a full disk never leaves a half-written file
under its final name, and what is written is strict JSON."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


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
