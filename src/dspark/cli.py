"""Shared behaviour of the entry points: user mistakes end in one clear line, not a traceback.

Every ``python -m dspark.X`` runs as ``launch(main)`` around its Hydra main, and the task inside
``user_errors()``: a mistake in the command line (an unknown key, a missing option, bad override
syntax), in the config (``dspark.core.errors.UserError``), a missing or unreadable file, or a full
disk prints ``dspark: error: …`` on one line and exits with status 2; Ctrl-C exits with 130."""

from __future__ import annotations

import errno
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from .core.errors import UserError

# OS errors a user fixes (a path, a permission, space): one line. Others keep their traceback.
USER_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS,
               errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.EEXIST}  # fmt: skip


@contextmanager
def user_errors():
    """Turn the project's own input errors (``dspark.core.errors``), Hydra's command-line errors,
    and the OS errors of a path, a permission or a full disk into ``dspark: error: …`` on one line
    and exit status 2; Ctrl-C into exit status 130."""
    try:
        yield
    except KeyboardInterrupt as err:
        print(f"dspark: interrupted{f': {err}' if str(err) else ''}", file=sys.stderr)
        sys.exit(130)
    except Exception as err:
        line = one_line(err)
        if line is None:
            raise
        _discard_hydra_run_dir()
        print(f"dspark: error: {line}", file=sys.stderr)
        sys.exit(2)


def launch(main) -> None:
    """Call a Hydra main so that its command-line errors take the one-line path too (Hydra prints
    them itself, with exit status 1, unless HYDRA_FULL_ERROR lets them through)."""
    os.environ["HYDRA_FULL_ERROR"] = "1"
    with user_errors():
        main()


def one_line(err: BaseException) -> str | None:
    """The one-line message of a user error, or None for anything else (a bug)."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

    if isinstance(err, UserError):
        return _flat(str(err))
    if isinstance(err, FileNotFoundError) or (isinstance(err, OSError) and err.errno in USER_ERRNOS):
        return _flat(f"{err.strerror}: {err.filename}" if err.filename else str(err))
    if isinstance(err, MissingConfigException) and err.options:
        return f"{err.missing_cfg_file} does not exist: choose one of {', '.join(err.options)}"
    if isinstance(err, OverrideParseException):
        return f"cannot read the override {err.override!r}: {_flat(str(err).split('See https://')[0])}"
    if isinstance(err, HydraException):
        key = getattr(err.__cause__, "full_key", None)
        if key and "not in struct" in str(err.__cause__):
            return f"unknown key {key}: check its spelling (--cfg job prints every key)"
        return _flat(str(err).split("See https://")[0])
    if isinstance(err, (MissingMandatoryValue, InterpolationResolutionError)):
        return f"{err.full_key}: {_flat(str(err).splitlines()[0])}"
    return None


def _flat(text: str) -> str:
    return " ".join(text.split())


def _discard_hydra_run_dir() -> None:
    """A command refused before it wrote anything leaves no folder behind: Hydra made its run folder
    (``.hydra/`` and the job's log) before the task ran; remove it when that is all it holds."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return
        hydra = HydraConfig.get()
        out, subdir = Path(hydra.runtime.output_dir), hydra.output_subdir
    except Exception:  # no Hydra run (a test, a notebook): nothing of Hydra's to remove
        return
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if out != Path.cwd() and names and names <= {str(subdir), f"{hydra.job.name}.log"}:
        shutil.rmtree(out, ignore_errors=True)
