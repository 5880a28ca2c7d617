"""What every typed folder shares: its path, strict-JSON files written atomically, and the one
descriptor file that carries the folder's schema stamp."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from ..core.io import atomic_write_json, finite, read_json, remove_temp_files
from ..core.lock import folder_lock
from . import schema


class Folder:
    kind: ClassVar[str]
    DESCRIPTOR: ClassVar[str]  # the file that carries the schema stamp

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    @contextlib.contextmanager
    def claimed(self, key: str) -> Iterator[Folder]:
        """This folder, held for writing by this process for the block: a second writer is refused
        (FolderInUseError naming the config ``key``), and the temp files a killed writer left in it
        (and in its sub-folders) are removed."""
        with folder_lock(self.path, key):
            for d in (self.path, *(p for p in self.path.iterdir() if p.is_dir())):
                remove_temp_files(d)
            yield self

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
