"""Shared behaviour of the entry points: user mistakes end in one clear line, not a traceback."""

from __future__ import annotations

import sys
from contextlib import contextmanager


def _user_error_types() -> tuple[type[BaseException], ...]:
    from .config import ConfigError
    from .data.io import DataError
    from .drafters import DrafterCheckpointError
    from .target import TargetError

    return (ConfigError, TargetError, DrafterCheckpointError, DataError, FileNotFoundError)


@contextmanager
def user_errors():
    """Turn the project's own input errors into `dspark: error: …` and exit status 2."""
    try:
        yield
    except _user_error_types() as err:
        print(f"dspark: error: {err}", file=sys.stderr)
        sys.exit(2)
