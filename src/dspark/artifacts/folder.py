"""What every typed folder shares: its path, strict-JSON files written atomically, and the one
descriptor file that carries the folder's schema stamp."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from ..core.io import atomic_write_json, finite, read_json
from . import schema


class Folder:
    kind: ClassVar[str]
    DESCRIPTOR: ClassVar[str]  # the file that carries the schema stamp

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    def file(self, name: str) -> Path:
        return self.path / name

    def write_json(self, name: str, obj: Any) -> Path:
        """Atomic strict JSON (NaN / inf become null); the descriptor gets the schema stamp."""
        if name == self.DESCRIPTOR:
            obj = schema.stamp(self.kind, obj)
        atomic_write_json(self.file(name), finite(obj))
        return self.file(name)

    def read_json(self, name: str, default: Any = ...) -> Any:
        """The file's JSON (``default`` when it is absent, else FileNotFoundError); the descriptor's
        schema stamp is checked."""
        path = self.file(name)
        if default is not ... and not path.is_file():
            return default
        obj = read_json(path)
        return schema.check(self.kind, obj, path) if name == self.DESCRIPTOR else obj
