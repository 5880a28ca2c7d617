"""Compiling without betting the run on it."""

from __future__ import annotations

import warnings

__all__ = ["EagerOnFailure"]


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
