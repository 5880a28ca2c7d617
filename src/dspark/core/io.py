"""Atomic file writes and JSON reading: a crash or a full disk never leaves a half-written file
under its final name, and what is written is strict JSON."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import DataError

TEMP_SUFFIX = ".tmp"  # atomic_open's temp files: .<name>.<random>.tmp beside the target


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", keep: str | Path | None = None, **kw) -> Iterator[Any]:
    """Write to a temp file beside `path` and rename it into place only when the block succeeds, so
    a crash or a full disk never leaves a half-written file under the final name. The file gets the
    usual mode (0644 under the common umask, not mkstemp's 0600) and is synced before the rename,
    the folder after it. `keep`: where the file it replaces moves first (the previous version)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if keep is not None and path.exists():
            os.replace(path, keep)
        os.replace(tmp, path)
        _sync_dir(path.parent)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.errno and err.filename is None:  # name the file (ENOSPC)
            raise OSError(err.errno, err.strerror or os.strerror(err.errno), str(path)) from err
        raise


def remove_temp_files(folder: str | Path) -> list[Path]:
    """Delete the temp files an interrupted atomic_open left in `folder` (a process killed while
    writing). Only for a folder this process owns (holds its lock), or a writer loses its file."""
    found = [p for p in Path(folder).glob(f".*{TEMP_SUFFIX}") if p.is_file()] if Path(folder).is_dir() else []
    for p in found:
        p.unlink(missing_ok=True)
    return found


@functools.cache
def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def _sync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (a crash right after it keeps the new name)."""
    with contextlib.suppress(OSError):  # not every platform or filesystem syncs a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
        f.write(json_text(obj) + "\n")


def json_text(obj: Any, level: int = 0) -> str:
    """``json.dumps(obj, indent=2, ensure_ascii=False, default=str)``, but a list with no list or
    dict in it on one line: a result's vectors (per position, per round) read as a line each
    instead of a line per number, and a run's per-round record stays a fraction of the size."""
    pad = "  " * level
    if isinstance(obj, dict) and obj:
        items = (f"{pad}  {_key(k)}: {json_text(v, level + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in obj):
        items = (f"{pad}  {json_text(v, level + 1)}" for v in obj)
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(obj, ensure_ascii=False, default=str)


def _key(key: Any) -> str:
    """A dict key as ``json.dumps`` writes it (a number or None becomes a string; other types raise)."""
    return json.dumps({key: 0}, ensure_ascii=False)[1:-4]


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def atomic_save_safetensors(path: str | Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save

    blob = save(tensors, metadata=metadata)
    with atomic_open(path, "wb") as f:
        f.write(blob)


def atomic_write_text(path: str | Path, text: str) -> Path:
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def atomic_savefig(fig, path: str | Path, **kw) -> Path:
    """A matplotlib figure saved atomically, in the format its suffix names."""
    path = Path(path)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=path.suffix.lstrip(".") or "png", **kw)
    return path


def read_json(path: str | Path) -> Any:
    """The JSON in `path`; a file that is not UTF-8 JSON is a DataError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not readable JSON ({_reason(err)}): fix or replace the file") from None


def read_jsonl(path: str | Path) -> list[dict]:
    """Strict reader for files this pipeline wrote itself (user files: prompts.read_prompt_jsonl)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path} is not readable JSON lines ({_reason(err)}): fix or replace it") from None


def _reason(err: ValueError) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"line {err.lineno}: {err.msg}"
    return "not UTF-8 text"
