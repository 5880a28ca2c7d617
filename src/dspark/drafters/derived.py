"""Tensors derived from a drafter's parameters for its inference fast paths (several projections'
weights concatenated, so that one GEMM replaces several), rebuilt when a parameter changes."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["DerivedWeights"]


class DerivedWeights:
    """``build(*sources())``, computed once and reused until a source parameter changes: another
    tensor object, storage, dtype or device (``.to()``, reassignment), or an in-place update (its
    version counter moves: optimizer steps, ``load_state_dict``). Writes through ``.data`` bypass
    the version counter and are not seen: call ``reset()`` after them.

    The check runs on the host, when ``get`` is called: at a CUDA graph's capture, never at its
    replay. A rebuild of the same shape, dtype and device is written into the tensor already handed
    out, so graphs captured earlier keep reading valid memory, and read the new weights once a
    host call (a new engine's capture, an eager call) has refreshed them; until then they replay
    the old ones."""

    def __init__(self, sources: Callable[[], Sequence[Tensor]], build: Callable[..., Tensor]):
        self._sources = sources
        self._build = build
        self._stamp: list[tuple] | None = None
        self._value: Tensor | None = None

    @staticmethod
    def _state(t: Tensor) -> tuple:
        return (t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape))

    def _fresh(self, sources: Sequence[Tensor]) -> bool:
        if self._stamp is None or len(self._stamp) != len(sources):
            return False
        return all(ref() is t and state == self._state(t) for t, (ref, state) in zip(sources, self._stamp))

    def get(self) -> Tensor:
        sources = list(self._sources())
        if not self._fresh(sources):
            with torch.no_grad():
                value = self._build(*sources).detach()
            old = self._value
            if old is not None and (old.shape, old.dtype, old.device) == (
                value.shape,
                value.dtype,
                value.device,
            ):
                with torch.inference_mode(old.is_inference()), torch.no_grad():
                    old.copy_(value)  # in place: addresses a captured graph holds stay valid
            else:
                self._value = value
            self._stamp = [(weakref.ref(t), self._state(t)) for t in sources]
        return self._value

    def reset(self) -> None:
        self._stamp, self._value = None, None
