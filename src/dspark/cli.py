"""Shared behaviour of the entry points: user mistakes end in one clear line, not a traceback."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from .core.errors import UserError


@contextmanager
def user_errors():
    """Turn the project's own input errors (``dspark.core.errors``) and missing files into
    ``dspark: error: …`` on one line and exit status 2."""
    try:
        yield
    except (UserError, FileNotFoundError) as err:
        print(f"dspark: error: {err}", file=sys.stderr)
        sys.exit(2)
