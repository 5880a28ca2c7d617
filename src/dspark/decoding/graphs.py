"""CUDA graphs captured per shape bucket, as serving engines do.

A step function that reads only static buffers (fixed addresses, contents copied in before each
replay) is captured once per key, e.g. ("target", rows bucket, width), and replayed afterwards.
Graphs of one family (the key's first element) share a memory pool. A graph's outputs may then
sit where a family member captured *earlier* keeps its temporaries, so they stay valid only until
another member replays; the engine consumes each step's outputs before its family runs again.
Families never share: the draft step's outputs must survive the target step that follows it
(sharing one pool let a target replay overwrite the drafted tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["GraphBank", "bucket_for"]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n (buckets sorted ascending)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}: add a larger one to engine buckets")


class GraphBank:
    captured = 0  # graphs captured by every bank of the process (what ``StallWatch`` counts)

    def __init__(self, device: torch.device, warmup: int = 2, capture_error_mode: str = "global"):
        self.device = device
        self.warmup = warmup
        # "thread_local" where other threads keep calling CUDA during a capture (a training loader's
        # pin-memory thread): "global" would count their calls against the capture and fail it.
        self.capture_error_mode = capture_error_mode
        self.pools: dict[Hashable, object] = {}
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}

    def run(self, key: Hashable, step: Callable[[], Any]) -> Any:
        """Replay the graph of ``key``, capturing ``step`` first if this key is new. ``step`` must
        be idempotent: it also runs eagerly during the warm-up before capture."""
        if key not in self.graphs:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # lazy inits (cuBLAS handles, workspaces) off the graph
                for _ in range(self.warmup):
                    step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            family = key[0] if isinstance(key, tuple) else key
            pool = self.pools.setdefault(family, torch.cuda.graph_pool_handle())
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=self.capture_error_mode):
                out = step()
            self.graphs[key] = (graph, out)
            GraphBank.captured += 1
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def clear(self) -> None:
        self.graphs.clear()

    def __len__(self) -> int:
        return len(self.graphs)
