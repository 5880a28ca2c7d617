"""Compiling without betting the run on it."""

from __future__ import annotations

import logging
import re
import warnings

__all__ = ["EagerOnFailure", "RecompileLimitWatch"]


class EagerOnFailure:
    """``compiled``, unless compiling it fails: then, with a warning naming the error, ``fn``
    itself (the same code, eagerly) from then on. A serving run then loses the fusion, not the
    run; the tests compile with their own counting compilers, so a failure fails them."""

    def __init__(self, compiled, fn):
        self.compiled, self.fn = compiled, fn
        self.error: Exception | None = None

    def __call__(self, *args, **kwargs):
        if self.error is None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as err:  # dynamo's and inductor's errors share no base class
                self.error = err
                name = getattr(self.fn, "__qualname__", repr(self.fn))
                warnings.warn(
                    f"torch.compile failed on {name}, which runs eagerly instead: {err!r}", stacklevel=2
                )
        return self.fn(*args, **kwargs)


class RecompileLimitWatch(logging.Handler):
    """The functions dynamo stopped compiling while this context was open (``hits``): past its
    recompile limit it runs a function's new shapes eagerly, with one log warning and no error,
    so a benchmark would time code it did not mean to and not know it. The H200's e2e rounds at
    R >= 16 once paid ~1.5 ms a round that way; the benchmarks now report it."""

    LOGGER = "torch._dynamo.convert_frame"  # where dynamo logs the limit (torch 2.x)

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            function = re.search(r"function: (.+)", message)
            self.hits.append(function.group(1).strip() if function else message.splitlines()[0])

    def __enter__(self) -> RecompileLimitWatch:
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)
