"""Advisory locks on the folders a command writes: a run folder, a data.dir. A second process that
would write the same folder is refused with one line instead of interleaving its files with the
first's. The lock is the ``.lock`` file in the folder, held (flock) while the command runs and
released by the kernel when the process ends, however it ends."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from .errors import FolderInUseError

LOCK_FILE = ".lock"


@contextlib.contextmanager
def folder_lock(folder: str | Path, key: str, shared: bool = False) -> Iterator[None]:
    """Hold ``folder``'s lock for the block: exclusive (the writer) or shared (readers, who keep a
    writer out). A conflicting holder raises FolderInUseError naming the config ``key`` to change."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: run unlocked
        yield
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise FolderInUseError(
                f"{key}={folder} is in use by another dspark command ({holder}): wait for it to end, "
                f"or choose another {key}"
            ) from None
        f.truncate(0)  # who holds it, for the message of the process it refuses
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        yield
