"""SPS(B) of the verification step: the target forward over R rows x W tokens (B = R·W), each row
attending to ``context`` cached positions (random K/V: the values do not change the work), then the
probabilities over the vocabulary, exactly what a verification round asks of the engine, timed as
  * ``hf_eager``: the plain engine's step (Hugging Face forward over ``RaggedKV``);
  * ``static_eager``: the fast engine's step without graphs (static caches only);
  * ``graph``: the fast engine's captured step (CUDA);
the drafter's step per row count and drafted length (backbone + sequential head + confidence +
sampling, the fast engine's graph), the parts of that step timed one by one, the host work of a
whole round that none of the steps shows (the cost model's ``overhead_ms``) and what a round loses
when its verify width is read back (``readback_ms``), whole rounds per row count and drafted length
as the engine runs them, and the kernels of each step, profiled.
``python -m dspark.bench.engine_sps`` prints and publishes them."""

from __future__ import annotations

import math
import statistics

import torch
from torch import Tensor

from ..checkpoints import load_drafter
from ..decoding.engine import Engine
from ..decoding.fast_engine import FastEngine
from ..decoding.graphs import GraphBank
from ..decoding.kv import RaggedKV
from ..scheduling.policies import Fixed
from .common import median_ms

__all__ = [
    "cost_curve",
    "draft_parts",
    "draft_step_times",
    "fewer_drafts_cost_no_more",
    "round_overhead_ms",
    "round_times",
    "row_counts",
    "served",
    "step_kernels",
    "verify_step_times",
]


def row_counts(widths: list[int], sizes: list[int], max_rows: int) -> list[int]:
    """Every R = B / W the sweep times (B a multiple of W, R in 1..max_rows)."""
    return sorted({b // w for w in widths for b in sizes if b % w == 0 and 0 < b // w <= max_rows})


def capacity(ctx: int, widths: list[int]) -> int:
    return 128 * math.ceil((ctx + max(widths) + 1) / 128)


def verify_step_times(
    target, widths: list[int], sizes: list[int], ctx: int, *, max_rows: int, warmup: int, repeats: int,
    hf: bool = True, compile: bool | None = None, temperature: float = 1.0,
) -> list[dict]:  # fmt: skip
    """One row per shape (B tokens as R x W): its step times in ms, SPS and the gain over HF eager.
    At ``temperature`` 0 the fast step ends in the target's argmax tokens (greedy rounds), else in
    its probabilities."""
    rows_all = row_counts(widths, sizes, max_rows)
    cap = capacity(ctx, widths)
    fast = FastEngine(
        target, None, concurrency=max(rows_all), buckets=rows_all, capacity=cap, max_width=max(widths),
        compile=compile, temperature=temperature,
    )  # fmt: skip
    fast._allocate(cap)  # the static caches
    plain = Engine(target, None, temperature=temperature)
    results = []
    with torch.inference_mode():
        for buf in fast.static.k + fast.static.v:
            buf.normal_()  # not zeros: power (and clocks) depend on the data
        fast.static.lengths.fill_(ctx)
        for w in widths:
            for b in sizes:
                if b % w or not 0 < b // w <= max_rows:
                    continue
                row = _measure(plain, fast, target, b // w, w, ctx, hf, warmup, repeats)
                results.append(row)
                nan = float("nan")
                print(
                    f"B={b:5d} R={b // w:4d} W={w}  hf={row.get('hf_eager_ms', nan):8.3f} ms  "
                    f"static={row['static_eager_ms']:8.3f} ms  graph={row.get('graph_ms', nan):8.3f} ms",
                    flush=True,
                )
    return results


def cost_curve(results: list[dict], widths: list[int]) -> dict[int, float]:
    """The verify curve of a cost table: rows γ+1 wide where B allows, single tokens below; the
    scheduler needs a non-decreasing curve, so noise dips are lifted to the running maximum."""
    w = max(widths)
    best = {r["tokens"]: r.get("graph_ms", r["static_eager_ms"]) for r in results if r["width"] == 1}
    best.update({r["tokens"]: r.get("graph_ms", r["static_eager_ms"]) for r in results if r["width"] == w})
    return _running_max(best)


def width_curves(results: list[dict], widths: list[int]) -> dict[int, dict[int, float]]:
    """The verify step per width, ``{W: {R: ms}}`` (``CostModel.verify_width_ms``): what a padded
    step of R rows at width W costs, each curve lifted to its running maximum like ``cost_curve``."""
    out = {}
    for w in widths:
        times = {r["rows"]: r.get("graph_ms", r["static_eager_ms"]) for r in results if r["width"] == w}
        if times:
            out[w] = _running_max(times)
    return out


def _running_max(times: dict[int, float]) -> dict[int, float]:
    """Each time lifted to the largest at or below its key: the scheduler needs non-decreasing curves."""
    out, top = {}, 0.0
    for k in sorted(times):
        top = max(top, times[k])
        out[k] = top
    return out


def _draft_engine(
    target, drafter, rows_all: list[int], ctx: int, cap: int, compile: bool | None, temperature: float,
    draft_vocab: Tensor | None = None,
) -> FastEngine:  # fmt: skip
    """A fast engine whose static drafter cache holds ``ctx`` random context positions per row."""
    eng = FastEngine(
        target, drafter, concurrency=max(rows_all), buckets=rows_all, capacity=cap, compile=compile,
        temperature=temperature, draft_vocab=draft_vocab,
    )  # fmt: skip
    eng._allocate(cap)
    with torch.inference_mode():
        for buf in eng.dcache.k + eng.dcache.v:
            buf.normal_()  # not zeros: power (and clocks) depend on the data
        eng.dcache.length.fill_(ctx)
    return eng


def served(drafter, target):
    """``drafter`` as the engines serve it: on the target's device, in its precision, eval mode."""
    return drafter.to(device=target.device, dtype=target.dtype).eval()


def load_served_drafter(target, drafter_dir: str):
    """A trained drafter as the engines serve it (``served``)."""
    return served(load_drafter(drafter_dir, target, device=target.device)[0], target)


def draft_step_times(
    target, drafter, rows_all: list[int], ctx: int, cap: int, warmup: int, repeats: int,
    compile: bool | None = None, lengths: list[int] | None = None, temperature: float = 1.0,
    draft_vocab: Tensor | None = None,
) -> dict[int, dict[int, float]]:  # fmt: skip
    """Draft-step time (ms) per drafted length and row count R, ``{γ_d: {R: ms}}``: the fast
    engine's captured step where CUDA is used (its layers compiled when ``compile``), ascending R
    lifted to the running maximum like ``cost_curve``; over ``draft_vocab``'s tokens where given."""
    device = target.device
    eng = _draft_engine(target, drafter, rows_all, ctx, cap, compile, temperature, draft_vocab)
    out: dict[int, dict[int, float]] = {}
    with torch.inference_mode():
        for m in lengths or range(1, drafter.gamma + 1):
            out[m] = {}
            for r in rows_all:
                anchors = torch.randint(0, target.vocab_size, (r,), device=device)
                pos = torch.full((r,), ctx, device=device)
                u = torch.rand(r, drafter.gamma, device=device)
                step = lambda a=anchors, p=pos, x=u, m=m: eng._draft_step(a, p, x, m)  # noqa: E731
                # A step cannot get cheaper with more rows: noise dips are lifted to the running max.
                out[m][r] = max([median_ms(step, device, warmup, repeats), *out[m].values()])
            times = "  ".join(f"R={r}: {t:.3f} ms" for r, t in out[m].items())
            print(f"draft γ_d={m}: {times}", flush=True)
    return out


def step_kernels(
    target, drafter, rows: list[int], ctx: int, compile: bool | None = None, temperature: float = 1.0,
    draft_vocab: Tensor | None = None,
) -> list[dict]:  # fmt: skip
    """Per row count R, the kernels of a round's steps, run eagerly and profiled
    (``kernel_profile.kernel_table``): the verify step at width 1 and γ + 1 (with a drafter it also
    writes the drafter's context, as in a round), the draft step of the whole block, a plain
    round's step with its token's draw (``plain``: what a round that drafts nothing costs a drafter
    engine) and target-only decoding's step beside it (``target_only``: the plain round's floor).
    Without a drafter, the verify step at width 1 and 8."""
    from .kernel_profile import kernel_table

    device = target.device
    gamma = int(drafter.gamma) if drafter is not None else 7
    widths = [1, gamma + 1]
    cap = capacity(ctx, widths)

    def target_only() -> FastEngine:
        e = FastEngine(
            target, None, concurrency=max(rows), buckets=rows, capacity=cap, compile=compile,
            temperature=temperature,
        )  # fmt: skip
        e._allocate(cap)
        return e

    floor = target_only()
    eng = (
        floor
        if drafter is None
        else _draft_engine(target, drafter, rows, ctx, cap, compile, temperature, draft_vocab)
    )
    out = []
    with torch.inference_mode():
        for e in dict.fromkeys((eng, floor)):  # one engine without a drafter
            e.bank, e.use_graphs = None, False  # eager: the profiler sees every kernel
            for buf in e.static.k + e.static.v:
                buf.normal_()
            e.static.lengths.fill_(ctx)
        for r in rows:
            first = len(out)
            for w in widths:
                ids = torch.randint(0, target.vocab_size, (r, w), device=device)
                pos = ctx + torch.arange(w, device=device).expand(r, -1)
                table = kernel_table(lambda i=ids, p=pos: eng._target_step(i, p), device)
                out.append({"step": "verify", "rows": r, "width": w, **table})
            if drafter is not None:
                a = torch.randint(0, target.vocab_size, (r,), device=device)
                p, u = torch.full((r,), ctx, device=device), torch.rand(r, gamma, device=device)
                table = kernel_table(lambda a=a, p=p, u=u: eng._draft_step(a, p, u, gamma), device)
                out.append({"step": "draft", "rows": r, "width": gamma, **table})
                # A plain round of a drafter engine: target-only's step plus the drafter context's
                # upkeep (taps into the ring, a flush every deferred_context rounds, amortised here).
                ids, pos = a[:, None], p[:, None]
                table = kernel_table(
                    lambda i=ids, p=pos: eng._plain_step(i, p), device, steps=4 * max(eng.deferred_context, 2)
                )
                out.append({"step": "plain", "rows": r, "width": 1, **table})
                table = kernel_table(lambda i=ids, p=pos: floor._plain_step(i, p), device)
                out.append({"step": "target_only", "rows": r, "width": 1, **table})
            for row in out[first:]:
                names = ", ".join(f"{k['name'][:40]} {k['us']:.1f}" for k in row["top"][:3])
                print(
                    f"kernels {row['step']} R={r} W={row['width']}: {row['kernels']:.0f} per step, "
                    f"{row['kernel_ms']:.3f} ms; top: {names}",
                    flush=True,
                )
    return out


def draft_parts(
    target, drafter, rows_all: list[int], ctx: int, warmup: int, repeats: int, temperature: float = 1.0,
    draft_vocab: Tensor | None = None,
) -> list[dict]:  # fmt: skip
    """The draft step's parts, each timed alone and eagerly (launch overheads included, which the
    captured step does not pay) per row count R: the backbone over the γ-block, the LM head over
    R × γ positions, the heads and sampling for all γ positions and for one, and the sampling
    alone: the fused single-program kernel, the split-V kernel (``choose_chunks``' C, at least 2, so
    rows past the chooser's limit show what splitting would cost there) and the PyTorch reference,
    these three as replays of a captured CUDA graph on CUDA (the price inside the draft step's graph,
    which decides between them; eager they would time their launches). Also captured: the drafter's
    own heads and sampling over the γ positions (``head_sampling_graph_ms``, the reference
    ``sample_block``: the engine's compiled per-position graphs launch fewer kernels, which the draft
    curve ``draft_len_ms`` times) against DFlash's parallel sampling of the same hidden states (one
    LM-head product, one sampling pass over all R × γ positions: ``parallel_sampling_graph_ms``);
    their difference bounds what the sequential head costs a draft step (``sequential_head_ms``,
    Fig. 4). A block drafter only (``sample_block``)."""
    if not hasattr(drafter, "sample_block"):
        print(f"draft parts: drafter '{drafter.kind}' is no block drafter; skipped", flush=True)
        return []
    cap = 128 * math.ceil((ctx + drafter.gamma + 16) / 128)
    eng = _draft_engine(
        target, drafter, [max(rows_all)], ctx, cap, compile=False, temperature=temperature,
        draft_vocab=draft_vocab,
    )  # fmt: skip
    out = []
    with torch.inference_mode():
        for r in rows_all:
            out.append(_parts_at(eng, r, ctx, temperature, warmup, repeats))
            print("draft parts " + "  ".join(f"{k}={v:.3f}" for k, v in out[-1].items()), flush=True)
    return out


def _parts_at(eng: FastEngine, r: int, ctx: int, temperature: float, warmup: int, repeats: int) -> dict:
    from ..kernels.sample_step import choose_chunks, sample_step

    drafter, shared, device = eng.drafter, eng.shared, eng.device
    gamma = drafter.gamma
    cache = eng._draft_cache(r)
    anchors = torch.randint(0, drafter.dims.vocab_size, (r,), device=device)
    pos = torch.full((r,), ctx, device=device)
    u = torch.rand(r, gamma, device=device)
    block = pos[:, None] + torch.arange(gamma, device=device)
    sees = torch.arange(cache.k[0].shape[2], device=device)[None, :] < cache.length[:, None]
    mask = torch.cat([sees, torch.ones(r, gamma, dtype=torch.bool, device=device)], 1)[:, None].expand(
        r, gamma, -1
    )
    kv = list(zip(cache.k, cache.v))
    hidden = drafter.backbone(drafter.block_inputs(anchors, shared), block, kv, mask)
    logits = hidden @ shared.lm_weight.t().to(hidden.dtype)

    def sampling(impl: str, chunks: int | None = None) -> None:
        for k in range(gamma):
            sample_step(logits[:, k], None, temperature, u[:, k], impl=impl, chunks=chunks)

    split = max(2, choose_chunks(r, logits.shape[-1]))
    bank = GraphBank(device) if device.type == "cuda" else None

    def captured(name: str, fn):
        return fn if bank is None else lambda: bank.run(name, fn)

    def parallel() -> None:  # DFlash's sample_block: no head, every position at once
        flat = (hidden @ shared.lm_weight.t().to(hidden.dtype)).flatten(0, 1)
        sample_step(flat, None, temperature, u.flatten())

    parts = {
        "propose_ms": lambda: drafter.propose(cache, anchors, pos, shared, temperature, uniforms=u),
        "backbone_ms": lambda: drafter.backbone(drafter.block_inputs(anchors, shared), block, kv, mask),
        "lm_head_ms": lambda: hidden @ shared.lm_weight.t().to(hidden.dtype),
        "heads_and_sampling_ms": lambda: drafter.sample_block(hidden, anchors, shared, temperature, u),
        "first_position_ms": lambda: drafter.sample_block(
            hidden[:, :1], anchors, shared, temperature, u[:, :1]
        ),
        "sampling_fused_ms": captured("fused", lambda: sampling("auto", 1)),
        "sampling_split_ms": captured("split", lambda: sampling("auto", split)),
        "sampling_reference_ms": captured("reference", lambda: sampling("torch")),
        "head_sampling_graph_ms": captured(
            "heads", lambda: drafter.sample_block(hidden, anchors, shared, temperature, u)
        ),
        "parallel_sampling_graph_ms": captured("parallel", parallel),
    }
    out = {"rows": r, **{name: median_ms(fn, device, warmup, repeats) for name, fn in parts.items()}}
    out["sequential_head_ms"] = max(0.0, out["head_sampling_graph_ms"] - out["parallel_sampling_graph_ms"])
    return out


def round_overhead_ms(
    target, drafter, cost, ctx: int, compile: bool | None = None, tokens: int = 48, temperature: float = 1.0,
    draft_vocab: Tensor | None = None,
) -> dict[str, float]:  # fmt: skip
    """What a whole round costs beyond its profiled steps, at R = 1: the fast engine decodes a
    random prompt of ``ctx`` tokens with the whole block drafted, then with plain rounds (no draft
    step), then with the whole block drafted but its width read back from the device, and each
    round's median time (the device's timeline, ``EngineResult.steps``) is compared with
    ``cost.round_time``. ``overhead_ms`` is what a drafting round adds on top of what a plain round
    adds (host work the device waited for, the eager kernels between the graphs); ``readback_ms``
    what the read-back adds to the same round (the device idle while the host launches the rest)."""
    eng, reqs = _round_engine(target, drafter, [1], ctx, compile, tokens, temperature, draft_vocab)
    measured = {
        name: _median_round_ms(eng, reqs, policy)
        for name, policy in (("drafting", Fixed(None)), ("plain", Fixed(0)), ("read_back", _ReadBack()))
    }
    spec = measured["drafting"] - 1e3 * cost.round_time(1, drafter.gamma)
    plain = measured["plain"] - 1e3 * cost.round_time(1, 0)
    out = {
        "drafting_round_ms": measured["drafting"],
        "plain_round_ms": measured["plain"],
        "read_back_round_ms": measured["read_back"],
        "drafting_extra_ms": spec,
        "plain_extra_ms": plain,
        "overhead_ms": max(0.0, spec - plain),
        "readback_ms": max(0.0, measured["read_back"] - measured["drafting"]),
    }
    print("round overhead " + "  ".join(f"{k}={v:.3f}" for k, v in out.items()), flush=True)
    return out


def round_times(
    target, drafter, rows_all: list[int], ctx: int, compile: bool | None = None, tokens: int = 32,
    lengths: list[int] | None = None, temperature: float = 1.0, passes: int = 3,
    draft_vocab: Tensor | None = None,
) -> dict[int, dict[int, float]]:  # fmt: skip
    """Whole rounds as the engine runs them, ``{γ_d: {R: ms}}`` for ``γ_d = 0..γ`` (0: a plain
    round; ``lengths``: only those) and each row count R: R requests of a random ``ctx``-token
    prompt decoded under ``Fixed(γ_d)`` (every row verifies its whole draft), the median round on
    the device's timeline, the least of ``passes`` passes over the lengths in turn: a transient
    (the clocks, a neighbour on the host) only adds time, and taking the lengths in turn keeps it
    from landing on every measurement of one (the H200, T = 0, R = 1: one pass priced γ_d = 6, 7
    0.14 ms above their rounds in the run, and hardware_aware drafted 5 where 7 paid).
    What the sum of separately timed steps misses is in it: the eager work between the graphs,
    the steps' overlap, how a round's cost really changes with γ_d; the draft-aware choices read
    it (``CostModel.round_len_ms``). Each R's times made non-decreasing in γ_d
    (``fewer_drafts_cost_no_more``), then ascending R lifted to the running maximum like ``cost_curve``.
    Without a drafter (``lengths=[0]``): target-only decoding's rounds, the floor a drafter engine's
    plain round (target-only's step plus the drafter context's upkeep) is held to."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    eng, _ = _round_engine(target, drafter, rows_all, ctx, compile, tokens, temperature, draft_vocab)
    wanted = list(range(drafter.gamma + 1) if lengths is None else lengths)
    who = "round" if drafter is not None else "target-only round"
    out: dict[int, dict[int, float]] = {m: {} for m in wanted}
    for r in rows_all:
        reqs = _round_requests(target, r, ctx)
        measured = dict.fromkeys(wanted, math.inf)
        for i in range(passes):
            for m in wanted:
                measured[m] = min(measured[m], _median_round_ms(eng, reqs, Fixed(m), warm=i == 0))
        for m, ms in fewer_drafts_cost_no_more(measured).items():
            out[m][r] = max([ms, *out[m].values()])
        times = "  ".join(f"γ_d={m}: {out[m][r]:.3f}" for m in out)
        print(f"{who} R={r}: {times} ms", flush=True)
    return out


def fewer_drafts_cost_no_more(ms: dict[int, float]) -> dict[int, float]:
    """``{γ_d: ms}`` with each time lowered to the least of the longer drafts' (a suffix minimum):
    a round that drafts and verifies fewer positions does no more work, so a time above a longer
    draft's is noise (the H200, T = 0, R = 16: γ_d = 1, 2 at 1.62 and 1.69 ms, γ_d = 3..7 at
    1.47-1.59), and noise only adds time."""
    out, least = {}, math.inf
    for m in sorted(ms, reverse=True):
        least = min(least, ms[m])
        out[m] = least
    return dict(sorted(out.items()))


def _round_engine(
    target, drafter, rows_all: list[int], ctx: int, compile: bool | None, tokens: int, temperature: float,
    draft_vocab: Tensor | None = None,
):  # fmt: skip
    """A fast engine for ``max(rows_all)`` requests of ``ctx`` prompt tokens and ``tokens`` new
    ones (no EOS: every request runs its whole budget), and the requests of the largest R."""
    eng = FastEngine(
        target, drafter, Fixed(None), temperature=temperature, concurrency=max(rows_all),
        max_new_tokens=tokens, buckets=tuple(rows_all), compile=compile, eos_token_ids=(),
        draft_vocab=draft_vocab,
    )  # fmt: skip
    reqs = _round_requests(target, max(rows_all), ctx)
    eng.prepare(reqs)
    return eng, reqs


def _round_requests(target, r: int, ctx: int) -> list:
    from ..decoding.engine import Request

    prompt = torch.randint(0, target.vocab_size, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    return [Request(prompt=list(prompt)) for _ in range(r)]


def _median_round_ms(eng, reqs, policy, warm: bool = True) -> float:
    """The median round of ``generate(reqs)`` under ``policy`` after a warm run (every graph of
    the policy captured, the allocator grown; ``warm=False``: the policy ran before); the first
    round (the prefill's) left out."""
    eng.set_policy(policy)
    if warm:
        eng.generate(reqs)
    steps = eng.generate(reqs).steps[1:]
    return statistics.median(s["ms"] for s in steps)


class _ReadBack(Fixed):
    """The whole block verified, its width read back from the device as a confidence-driven
    policy's is (``round_overhead_ms``)."""

    def width(self, drafted: int) -> None:
        return None


def _measure(plain, fast, target, r: int, w: int, ctx: int, hf: bool, warmup: int, repeats: int) -> dict:
    """One shape: R rows x W tokens at positions ctx.. (no commit: every repeat redoes the same slots)."""
    device = target.device
    ids = torch.randint(0, target.vocab_size, (r, w), device=device)
    pos = ctx + torch.arange(w, device=device).expand(r, -1)
    row = {"tokens": r * w, "rows": r, "width": w, "context": ctx}
    if hf:
        plain._kv = RaggedKV.empty(target.model.config, r, ctx + w, target.dtype, device)
        for buf in plain._kv.k + plain._kv.v:
            buf.normal_()
        plain._kv.length.fill_(ctx)
        row["hf_eager_ms"] = median_ms(lambda: plain._target_step(ids, pos), device, warmup, repeats)
        plain._kv = None
    bank, fast.bank, fast.use_graphs = fast.bank, None, False
    row["static_eager_ms"] = median_ms(lambda: fast._target_step(ids, pos), device, 2, repeats)
    fast.bank, fast.use_graphs = bank, bank is not None
    if bank is not None:
        row["graph_ms"] = median_ms(lambda: fast._target_step(ids, pos), device, warmup, repeats)
    best = row.get("graph_ms", row["static_eager_ms"])
    row["sps"] = 1e3 / best
    if "hf_eager_ms" in row:
        row["speedup_vs_hf"] = row["hf_eager_ms"] / best
    return row
