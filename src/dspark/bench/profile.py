"""Step times for a cost table: the target's verification forward over B tokens and the drafter's
proposal for R requests, timed on the device (python -m dspark.schedule mode=measured profiles
these when no cost table is given), and the clean-up of a noisy timing table."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch

from ..core.types import Shared
from ..decoding.kv import RaggedKV
from ..scheduling.cost import profile

log = logging.getLogger(__name__)

__all__ = ["profile_drafter", "profile_target", "settle_profile"]


def _verify_shape(B: int, gamma: int) -> tuple[int, int]:
    """Rows x tokens for a verification of ~B tokens: full blocks of γ+1 (anchor + γ drafts), the
    shape a block drafter verifies; the engine pads rows to the longest, so this is the shape it
    pays for. rows·tokens >= B by less than one row."""
    rows = max(1, -(-B // (gamma + 1)))
    return rows, -(-B // rows)


def profile_target(
    target, batch_sizes: Iterable[int], context_len: int, gamma: int, warmup: int = 2, repeats: int = 5
) -> dict[int, float]:
    """Step time (ms) of the target's verification forward over ``B`` tokens, each row attending
    to ``context_len`` cached positions (random K/V stand in for a prefill: the values do not
    change the work, only the time a prefill would take)."""
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    built: dict[int, tuple] = {}

    def step(B: int) -> None:
        if B not in built:
            built.clear()  # one shape alive at a time: large B caches are big
            rows, t = _verify_shape(B, gamma)
            kv = RaggedKV.empty(target.model.config, rows, context_len + t, target.dtype, target.device)
            for buf in kv.k + kv.v:  # not zeros: GPU power (and so clocks) depends on the data
                buf.normal_()
            kv.length.fill_(context_len)
            ids = torch.randint(0, target.vocab_size, (rows, t), device=target.device)
            pos = context_len + torch.arange(t, device=target.device).expand(rows, -1)
            built[B] = (kv, ids, pos)
        kv, ids, pos = built[B]
        mask = kv.plan(ids.shape[1], target.dtype)  # no commit: every repeat verifies the same slots
        target(ids, positions=pos, cache=kv, attention_mask=mask, use_cache=True)

    with torch.inference_mode():
        return profile(step, batch_sizes, warmup=max(1, warmup), repeats=repeats)


def profile_drafter(
    target,
    drafter,
    concurrency: Iterable[int],
    context_len: int,
    temperature: float = 1.0,
    warmup: int = 2,
    repeats: int = 5,
    draft_vocab=None,
) -> dict[int, float]:
    """Step time (ms) of ``drafter.propose`` for R requests over ``context_len`` context positions
    (over ``draft_vocab``'s tokens where given)."""
    shared = Shared.of(target, draft_vocab)
    device = target.device
    built: dict[int, tuple] = {}
    gen = torch.Generator().manual_seed(0)

    def step(R: int) -> None:
        if R not in built:
            built.clear()
            cache = drafter.new_cache(R, device)
            taps = torch.randn(R, context_len, target.tap_dim, device=device, dtype=target.dtype)
            pos = torch.arange(context_len, device=device).expand(R, -1)
            nxt = torch.randint(0, target.vocab_size, (R, context_len), device=device)
            valid = torch.ones(R, context_len, dtype=torch.bool, device=device)
            drafter.extend_context(cache, taps, pos, valid, nxt, shared)
            anchors = torch.randint(0, target.vocab_size, (R,), device=device)
            built[R] = (cache, anchors, torch.full((R,), context_len, device=device))
        cache, anchors, apos = built[R]
        drafter.propose(cache, anchors, apos, shared, temperature, gen)

    with torch.inference_mode():
        return profile(step, concurrency, warmup=max(1, warmup), repeats=repeats)


def _spikes(table: Mapping[int, float], tol: float) -> list[int]:
    """Batch sizes timed slower than some larger batch by more than ``tol``: a step cannot get
    cheaper with more tokens, so the smaller one was disturbed (preemption, GC, a cold cache)."""
    bs = sorted(table)
    return [b for i, b in enumerate(bs) if any(table[b] > (1 + tol) * table[c] for c in bs[i + 1 :])]


def _isotonic(bs: Sequence[int], ts: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for t in ts:
        blocks.append([t, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def settle_profile(
    run, sizes: Sequence[int], tol: float = 0.05, retries: int = 2
) -> tuple[dict[int, float], dict]:
    """``run(sizes) -> {B: ms}``, re-timing the points that a larger batch undercuts (timing noise
    only ever adds time, so the smaller of two medians is kept); what still dips after ``retries``
    is smoothed by an isotonic fit. Returns the table and notes for the cost model's meta."""
    table = dict(run(list(sizes)))
    notes: dict = {}
    for _ in range(retries):
        bad = _spikes(table, tol)
        if not bad:
            return table, notes
        again = run(bad)
        notes.setdefault("retimed", []).extend(bad)
        table = {b: min(t, again.get(b, t)) for b, t in table.items()}
    if _spikes(table, tol):
        bs = sorted(table)
        notes["raw_ms"] = {str(b): table[b] for b in bs}
        table = dict(zip(bs, _isotonic(bs, [table[b] for b in bs])))
        log.warning(
            "profile still dips after %d re-timings; using an isotonic fit (raw times in meta)", retries
        )
    return table, notes
