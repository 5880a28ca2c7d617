"""Each folder a stage writes names its kind and version in one file, ``"schema":
"dspark.<kind>/v<N>"``, so a reader refuses what it cannot read instead of misreading it. Files
written before folders were versioned carry no stamp and read as the current layout (v1 kept it)."""

from __future__ import annotations

import re
from pathlib import Path

from ..core.errors import DataError

SCHEMA_VERSION = 1
_TAG = re.compile(r"dspark\.([a-z_]+)/v(\d+)")


def stamp(kind: str, record: dict) -> dict:
    return {"schema": f"dspark.{kind}/v{SCHEMA_VERSION}", **record}


def check(kind: str, record: dict, where: Path) -> dict:
    """``record`` (read from ``where``) if it is a ``kind`` file this version can read."""
    tag = record.get("schema") if isinstance(record, dict) else None
    if tag is None:
        return record
    m = _TAG.fullmatch(str(tag))
    if m is None:
        raise DataError(f"{where}: unknown schema {tag!r} (expected dspark.{kind}/v<N>)")
    if m.group(1) != kind:
        raise DataError(f"{where} is a dspark {m.group(1)} file, not a {kind} file")
    if int(m.group(2)) > SCHEMA_VERSION:
        raise DataError(
            f"{where} was written by a newer dspark ({tag}); this one reads up to v{SCHEMA_VERSION}: "
            f"upgrade dspark"
        )
    return record
