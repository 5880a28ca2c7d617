"""The frozen target's training forward replayed from CUDA graphs.

A small target's training forward waits on the host, not the GPU: SmolLM2-135M's 30 compiled decoder
layers, called one by one with their tap hooks, took 67.9 ms of host time for 7.0 ms of kernels a
step (docs/results/h100-smollm2-2026-12-08), and the device sat idle 68 % of the step. Replayed
from a CUDA graph the whole forward is one launch.

A graph has fixed shapes and addresses. Each batch is copied into a static buffer of ids whose
length is the batch's rounded up to a multiple of ``multiple`` tokens: one graph per (rows, padded
length), captured the first time it is met. The positions past the batch hold whatever ids the
buffer had; causal attention keeps every real position from seeing them (as it keeps the
batch's own right padding out), and their outputs are dropped. Every graph writes its taps and
final hidden states into one pair of static buffers, so memory holds one batch's outputs however
many graphs there are; the caller gets copies, valid however long it keeps them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

from .decoding.graphs import GraphBank

__all__ = ["FeatureGraphs"]

log = logging.getLogger(__name__)

Features = Callable[[Tensor], tuple[Tensor, Tensor]]


class FeatureGraphs:
    """``features(ids) -> (taps [B, T, tap_dim], last_hidden [B, T, hidden])`` through padded
    static buffers, replayed from CUDA graphs when ``graphs`` (else run as is: the padding and
    buffers alone, which the CPU tests check against the plain forward). A failure on that path (a
    capture CUDA refuses, say) does not end the run: ``features`` goes on unpadded, with a warning."""

    @classmethod
    def of(cls, target, multiple: int = 64) -> FeatureGraphs | None:
        """For a `Target`'s training forward (``Target.features``, compiled or not); None, with a
        warning, off CUDA."""
        if target.device.type != "cuda":
            log.warning("CUDA graphs need a CUDA device (the target is on %s): its forward runs as it is",
                        target.device)  # fmt: skip
            return None
        return cls(target.features, target.tap_dim, target.hidden_size, target.dtype, multiple=multiple)

    def __init__(
        self,
        features: Features,
        tap_dim: int,
        hidden_size: int,
        dtype: torch.dtype,
        multiple: int = 64,
        graphs: bool = True,
    ):
        if multiple < 1:
            raise ValueError(f"graph_target_multiple must be a positive number of tokens, got {multiple}")
        self.features = features
        self.tap_dim, self.hidden_size, self.dtype = int(tap_dim), int(hidden_size), dtype
        self.multiple = int(multiple)
        self.graphs = bool(graphs)
        self.failed = False
        self.bank: GraphBank | None = None
        self.ids: Tensor | None = None  # [rows, length] capacity; grown (graphs dropped) when outgrown
        self.taps: Tensor | None = None
        self.hidden: Tensor | None = None

    def padded_length(self, length: int) -> int:
        return -(-int(length) // self.multiple) * self.multiple

    @property
    def captured(self) -> int:
        return len(self.bank) if self.bank is not None else 0

    def __call__(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        if not self.failed:
            try:
                return self._padded(ids)
            except (RuntimeError, torch._dynamo.exc.TorchDynamoException) as err:
                log.warning(
                    "the target forward's CUDA graphs failed (%s): training goes on without them", err
                )
                self.failed = True  # its graphs and buffers go: nothing held for a path no longer used
                self.bank = self.ids = self.taps = self.hidden = None
        return self.features(ids)

    def _padded(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        rows, length = ids.shape
        padded = self.padded_length(length)
        self._reserve(rows, padded, ids.device)
        self.ids[:rows, :length].copy_(ids)
        if self.bank is None:
            self._step(rows, padded)
        else:
            self.bank.run((rows, padded), lambda: self._step(rows, padded))
        return self.taps[:rows, :length].clone(), self.hidden[:rows, :length].clone()

    def _step(self, rows: int, padded: int) -> None:
        taps, hidden = self.features(self.ids[:rows, :padded])
        self.taps[:rows, :padded].copy_(taps)
        self.hidden[:rows, :padded].copy_(hidden)

    def _reserve(self, rows: int, padded: int, device: torch.device) -> None:
        """Buffers for ``rows`` x ``padded``: kept while they fit, else regrown (twice the length
        that outgrew them, so a run regrows a handful of times) with every graph dropped, since each
        graph reads and writes the old buffers' addresses."""
        if self.ids is not None and self.ids.device == device:
            have_rows, have_length = self.ids.shape
            if rows <= have_rows and padded <= have_length:
                return
            rows, padded = max(rows, have_rows), max(padded, 2 * have_length)
        # Normal tensors even when the first batch comes inside inference mode (validation's sanity
        # check): training writes into them later, which an inference tensor would refuse.
        with torch.inference_mode(False):
            self.ids = torch.zeros(rows, padded, dtype=torch.long, device=device)
            self.taps = torch.empty(rows, padded, self.tap_dim, dtype=self.dtype, device=device)
            self.hidden = torch.empty(rows, padded, self.hidden_size, dtype=self.dtype, device=device)
        # thread_local: a training loader's pin-memory thread goes on calling CUDA beside a capture
        on_cuda = self.graphs and device.type == "cuda"
        self.bank = GraphBank(device, capture_error_mode="thread_local") if on_cuda else None
