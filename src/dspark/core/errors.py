"""The project's own error types: mistakes the user can fix from the message alone. Every entry
point prints one as a single ``dspark: error: …`` line and exits with status 2
(``dspark.cli.user_errors``); anything else is a bug and keeps its traceback."""

from __future__ import annotations


class UserError(ValueError):
    """An input the user can fix; the message names the key, file or value to change."""


class ConfigError(UserError):
    """A config that cannot work, caught before any model loads."""


class DataError(UserError):
    """Bad data or a data config that cannot work; the message names the key or file to fix."""


class TargetError(UserError):
    """A target that cannot be used as configured; the message names the fix."""


class DrafterCheckpointError(UserError):
    """A drafter folder that cannot be read, or that does not fit the target it is used with."""


class FolderInUseError(UserError):
    """A folder another dspark process is writing (or reading while this one would write)."""
