"""Small tensors made once and shared by callers that only read them."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import Tensor

__all__ = ["kept_tensor"]


def kept_tensor(cache: dict, key: Hashable, make: Callable[[], Tensor], limit: int = 256) -> Tensor:
    """``make()`` the first time ``key`` is asked, the same tensor afterwards: a fill or an arange
    launched every decode round is host time the round waits for. A plain tensor (made outside
    inference mode), usable in either mode. Past ``limit`` keys the cache starts afresh: row counts
    vary as requests finish, and the recent ones are those asked."""
    t = cache.get(key)
    if t is None:
        if len(cache) >= limit:
            cache.clear()
        with torch.inference_mode(False):
            t = cache[key] = make()
    return t
