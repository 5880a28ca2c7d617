"""The batched speculative-decoding engine (plain PyTorch; the CPU reference).

One round for the R running requests:
  0. plan     before drafting, the policy says how many positions γ_d <= γ to draft
              (``Policy.draft_length``, from completed rounds only; 0 = a plain decoding round);
  1. draft    ``drafter.propose`` from each anchor (the last token the target produced, not yet in
              its cache) -> γ_d tokens, their exact sampling distributions, confidence logits;
  2. lengths  the policy picks ℓ_r <= γ_d from calibrated confidences c_k = σ(z_k / T_k + b_k);
  3. verify   one target forward over [anchor, d_1..d_ℓ] per row (ragged rows padded to max ℓ + 1),
              then lossless rejection sampling (``verify``) -> n_r accepted + one new token;
  4. commit   the target cache keeps positions a..a+n, the drafter context gets their features,
              and the new token becomes the next anchor at a+n+1.
Steps 0-4 are launched without reading anything back (``_launch``); the host reads a round's
outcome (tokens, EOS, budgets, the policy's feedback: ``_complete``) after launching the next one,
so on CUDA the host's work hides behind the device's; the per-row ``RoundRecord``s are built from
what it kept after the last round. The price: a request that ended in round t rides along in round
t + 1 (its tokens there are void) before its row is freed. Requests stop at EOS or max_new_tokens;
waiting prompts join as others finish (continuous batching: finished rows are dropped from both
caches, new rows are prefilled and appended).
Without a drafter the same loop is target-only decoding (ℓ = 0: the verifier samples from p_t),
which is the baseline and the reference of the losslessness tests. p_t is softmax(logits / T),
filtered by top-k / top-p when asked (``decoding.sampling``), for sampling and verification alike.

For bulk generation (the data pipeline) three knobs trade bookkeeping for throughput: ``refill``
(finished rows idle until that many are free, then leave together and the waiting prompts join in
one prefill: one cache compaction per batch of finished rows instead of one per row),
``record_rounds=False`` (no per-row ``RoundRecord``) and ``generate(on_result=...)`` (each request
is handed over the moment it finishes).

``FastEngine`` (fast_engine.py) runs the same rounds over static caches with CUDA graphs: it
overrides only the cache hooks (``_prefill_forward``, ``_target_step``, ``_commit``,
``_keep_rows``, ``_propose``, ``_verify`` ...). A round reads back only ``max ℓ`` (the verify
width) and only under a policy whose width depends on the confidences (``Policy.width``).
Joining requests are prefilled behind the round in flight (stream order keeps its rows' writes
before the moves and the prompts' writes), and the prefill reads nothing back: its first tokens
are emitted when the next round completes. ``EngineResult.steps`` times each round: ``ms`` (its
span on the device's timeline, or the host's clock on the CPU), ``gpu_ms`` (the device's work
from the round's first operation to its last), ``host_ms`` (the host's own work for the round,
launching it and reading its outcome, waits excluded; of it ``launch_ms`` the launch, split by
``launch_parts`` into ``LAUNCH_PARTS``, and ``policy_ms`` the policy's calls), ``wait_ms`` (the
host blocked on the round's outcome: its device work was the longer) and ``readback_ms`` (the host
blocked on a read-back of the verify width, a bubble on the device); ``cycle_ms`` is the host's clock
from the previous round's completion to this one's (one pass of the rounds' loop: the next round's
launch, this one's wait and completion, and ``between_ms``, the work outside launching and completing
rounds: leaving and joining requests, the joiners' prefill, results handed over), so that the host
sets the pace where ``cycle_ms - wait_ms`` reaches the round's ``ms``; ``events`` counts the one-off
work since the previous round's record (graph captures, compiles, GC passes: ``stall_watch``), which
is where a round far slower than its median finds its cause; ``plan``, under a policy that weighs
drafted lengths, what decided this round's (``Policy.plan_record``). A round that drafts nothing runs
``_plain_step``: target-only decoding's step with its token (its ``target`` part holds both; the
fast engine draws the token inside the step's graph, and defers the drafter's context of such
rounds and writes it in one batch before the next draft). While ``generate`` runs, Python's
cyclic garbage collector is off and the objects alive before it are frozen out of it
(``gc.freeze``): the rounds leave no cyclic garbage (a test holds them to it), so a collection
could only stall them; a pass over the process's heap (the model, torch.compile's caches) takes a
large part of a second, and on the H200 a single pass inside a run still took 0.44-0.57 s in 11 of
144 timed runs with the heap frozen (session 2026-12-04-c).

Randomness comes from one ``torch.Generator`` (CPU by default) in a fixed order per round: the
drafter's uniforms [R, γ] (only when it drafts), then verify's ``u_accept [R, γ_d]`` (cut to the
verified width) and ``u_sample [R]``; prefill draws one uniform per joining request. Uniforms are
drawn on the generator's device and moved (pinned and asynchronous from the CPU to CUDA), so a
CUDA path can keep the same streams.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..calibration.sts import Calibration
from ..core.progress import progress_bar
from ..core.sampling import sample_from
from ..core.tensors import kept_tensor
from ..core.types import Shared
from ..scheduling.policies import Fixed, Policy
from .draft_vocab import check_draft_vocab
from .kv import RaggedKV, concat_draft_caches, select_draft_cache
from .sampling import target_probs
from .stall_watch import StallWatch
from .uncertainty import per_request_positions
from .verify import VerifyResult, one_hot_drafts, verify

__all__ = [
    "Engine",
    "EngineResult",
    "Generation",
    "LAUNCH_PARTS",
    "Request",
    "RoundRecord",
    "calibration_arrays",
    "conditional_acceptance",
    "launch_parts",
    "retire_order",
    "tau",
    "threshold_sweep",
]


@dataclass
class Request:
    prompt: Sequence[int]
    id: Any = None
    max_new_tokens: int | None = None  # None: the engine's default


@dataclass
class Generation:
    id: Any
    prompt_len: int
    tokens: list[int]  # generated tokens (prompt excluded), EOS included when it ended the request
    finish: str  # "eos" | "length"
    rounds: int  # verification rounds (the prefill token is not a round)
    accepted: int  # draft tokens accepted over all rounds


@dataclass
class RoundRecord:
    """One request in one round. ``accepted + 1`` tokens came out of the verifier; ``emitted`` of
    them were kept (fewer only in a request's last round, cut at EOS / max_new_tokens)."""

    request: Any
    round: int  # this request's round index (0-based)
    step: int  # engine-wide round index
    batch: int  # requests in this round
    anchor_pos: int
    drafted: int  # γ, the drafter's block (``EngineResult.steps`` says how many were drafted)
    proposed: int  # ℓ chosen by the policy
    accepted: int  # n <= ℓ
    emitted: int
    accept_flags: list[bool]  # per verified position (length ℓ)
    confidence_logits: list[float] | None = None  # raw z_k, all γ positions
    confidence: list[float] | None = None  # σ(z_k / T_k + b_k): calibrated per-position c_k

    def to_dict(self) -> dict:
        return asdict(self)


# What putting a round on the device consists of, in order (``launch_parts``): the policy's γ_d (and the
# round's start event), the draft step, the lengths (calibration, the policy's lengths and width; a
# width's read-back excluded), the target step (its inputs built, staged and run), verification, the
# commit (the idle rows, the caches' lengths; the plain engine's drafter context) and the outcome's
# copies to the host.
LAUNCH_PARTS = ("plan", "draft", "lengths", "target", "verify", "commit", "copies")


def launch_parts(marks: Sequence[float]) -> dict[str, float]:
    """The host's ms in each of ``LAUNCH_PARTS`` from the clock at the launch's start and at the end
    of each part (``_Round.marks``). They add up to the round's ``launch_ms``."""
    return {name: 1e3 * (b - a) for name, a, b in zip(LAUNCH_PARTS, marks, marks[1:])}


def packed_copies(tensors: dict[str, Tensor], copy: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """The tensors copied by ``copy`` as one flat tensor per dtype, handed back as views of it
    (same names, shapes and values)."""
    out = {}
    for dtype in {t.dtype for t in tensors.values()}:
        group = {k: t for k, t in tensors.items() if t.dtype == dtype}
        flat = copy(torch.cat([t.reshape(-1) for t in group.values()]))
        start = 0
        for k, t in group.items():
            out[k] = flat[start : start + t.numel()].view(t.shape)
            start += t.numel()
    return out


@dataclass
class EngineResult:
    generations: list[Generation]  # in request order
    rounds: list[RoundRecord]
    steps: list[dict] = field(default_factory=list)  # per engine round: R, verified tokens, ms
    wall_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return sum(len(g.tokens) for g in self.generations)

    @property
    def tau(self) -> float:
        """Mean tokens per verification round, bonus/correction token included (paper's τ)."""
        return sum(r.accepted + 1 for r in self.rounds) / max(len(self.rounds), 1)


@dataclass
class _Live:
    """A running request (row i of the batch tensors)."""

    index: int  # position in the input order
    req: Request
    budget: int
    tokens: list[int]
    rounds: int = 0
    accepted: int = 0
    finish: str | None = None
    # The prefill's token, not read yet: (its host copy, this row's index in it). The prefill reads
    # nothing back; the first round after it does, and emits this token before its own.
    first: tuple[Tensor, int] | None = None

    def due(self, rounds: int) -> bool:
        """The next ``rounds`` rounds' tokens (one at least each) exhaust the budget."""
        return len(self.tokens) + (self.first is not None) + rounds >= self.budget


@dataclass
class _RoundRows:
    """A completed round's outcome as read back, with each live row's request, its round index and
    the tokens it kept: ``generate`` turns it into the round's ``RoundRecord``s after the last
    round, off the rounds' clock (building them took ~1 ms of host time a round at 256 rows: a
    plain round's whole device time, at that load)."""

    step: int
    batch: int
    drafted: int  # γ, the drafter's block
    host: dict[str, list]  # the round's outcome per row (``_complete``)
    rows: list[tuple[int, Any, int, int]]  # (row, request id, its round, tokens kept), live rows

    def records(self) -> list[RoundRecord]:
        h = self.host
        zl, cl = h.get("conf_logits"), h.get("conf")
        out = []
        for i, request, index, emitted in self.rows:
            ell, n = h["lengths"][i], h["accepted"][i]
            out.append(
                RoundRecord(
                    request=request,
                    round=index,
                    step=self.step,
                    batch=self.batch,
                    anchor_pos=h["pos"][i],
                    drafted=self.drafted,
                    proposed=ell,
                    accepted=n,
                    emitted=emitted,
                    accept_flags=[True] * min(n, ell) + [False] * (ell - n),
                    confidence_logits=None if zl is None else zl[i],
                    confidence=None if cl is None else cl[i],
                )
            )
        return out


@dataclass
class _Round:
    """A round on the device whose outcome the host reads later (``Engine._complete``)."""

    step: int
    items: list[_Live]  # the request of each row when the round was launched
    drafted: int  # γ_d: positions drafted this round (0: plain decoding)
    out: dict[str, Tensor]  # host copies of its outcome (in flight on CUDA until ``stamp`` ends)
    stamp: tuple | None  # its CUDA events (``_Clock``)
    # The host's clock at the launch's start and at the end of each of LAUNCH_PARTS, waits excluded
    marks: tuple[float, ...]
    readback_s: float = 0.0  # host time blocked on the verify width's read-back
    policy_s: float = 0.0  # of the launch, the policy's calls (its choices and their device work)
    plan: tuple | None = None  # what decided ``drafted`` (``Policy.plan_record``), for the round's record

    @property
    def launch_s(self) -> float:
        """Host time spent launching it, waits excluded."""
        return self.marks[-1] - self.marks[0]


class _Clock:
    """Per-round timing. On CUDA, from events read one round late: ``ms`` spans the device's
    timeline from the end of its previous work (round or prefill) to the end of this round, idle
    gaps included, and ``gpu_ms`` from the round's first operation to its last. On the CPU the work
    is synchronous and the host's clock is the round's time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._last = self._start = None

    @staticmethod
    def _event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        """Device work that is no round ended here (a prefill)."""
        if self.cuda:
            self._last = self._event()

    def launch(self) -> None:
        if self.cuda:
            self._start = self._event()
            if self._last is None:
                self._last = self._start

    def end(self) -> tuple | None:
        if not self.cuda:
            return None
        end = self._event()
        stamp, self._last = (self._last, self._start, end), end
        return stamp

    @staticmethod
    def read(stamp: tuple | None) -> dict:
        """``{"ms", "gpu_ms"}`` of a round (waits for its end); empty on the CPU."""
        if stamp is None:
            return {}
        last, start, end = stamp
        end.synchronize()
        return {"ms": last.elapsed_time(end), "gpu_ms": start.elapsed_time(end)}


class Engine:
    """Speculative decoding with ``drafter``, or target-only decoding when ``drafter`` is None.

    Args:
        target: a ``dspark.target.Target``.
        drafter: any drafter with ``new_cache / extend_context / propose`` (None = target only).
        policy: a ``scheduling.policies.Policy`` (default: verify the whole drafted block).
        temperature: sampling temperature of target and drafter (0 = greedy).
        top_k, top_p: the target's filter (0 and 1 = none): p_t keeps the k most likely tokens,
            then the top-p nucleus of their renormalised distribution (transformers' warpers).
        concurrency: requests decoded together; more prompts wait in a queue.
        max_new_tokens: default per-request budget.
        calibration: STS temperatures [γ] for the confidence logits (a list, a tensor, a
            ``Calibration``, whose offsets b give σ(z / T + b)); None = raw σ(z).
            ``from_checkpoint`` reads ``calibration.json``.
        cost: ``CostModel`` for the load-aware policies.
        eos_token_ids: stop tokens (default: the target's); ``()`` never stops early.
        seed / generator: the random stream (see the module docstring).
        progress: show a progress bar over finished requests.
        refill: finished rows leave the batch (and waiting requests join) once at least this
            many are finished; until then they idle in their rows (1: at once).
        record_rounds: keep a ``RoundRecord`` per request per round (``EngineResult.rounds``).
        record_confidence: with ``record_rounds``, keep each round's confidences in its records
            (the calibration's evidence); False copies none back (2 · R · γ floats a round read on
            the host: timed runs that only need the tokens and acceptance).
        pipeline: rounds launched ahead of the one the host reads (1: round t goes onto the device
            before round t - 1 is read; 2: before t - 2, so the device keeps a round queued while the
            host reads one, for a host whose cycle is about as long as a round). Each one more lets a
            finished request ride along one more round (its tokens dropped) and plans rounds from
            outcomes one round older: still non-anticipating.
        draft_vocab: [K] sorted target token ids the drafter drafts among (``decoding.draft_vocab``:
            the K most frequent of its training answers); its draft step's LM head and softmax then
            cover K columns. None: the whole vocabulary. Lossless either way.
    """

    _static_sampling = False  # top-p by candidates with host syncs; FastEngine sorts statically

    def __init__(
        self,
        target,
        drafter=None,
        policy=None,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        concurrency: int = 8,
        max_new_tokens: int = 256,
        calibration=None,
        cost=None,
        eos_token_ids: Iterable[int] | None = None,
        seed: int = 0,
        generator: torch.Generator | None = None,
        progress: bool = False,
        desc: str = "decode",
        refill: int = 1,
        record_rounds: bool = True,
        record_confidence: bool = True,
        pipeline: int = 1,
        draft_vocab: Tensor | None = None,
    ):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if top_k < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
        if pipeline not in (1, 2):
            raise ValueError(f"pipeline must be 1 or 2 rounds launched ahead of the one read, got {pipeline}")
        self.pipeline = int(pipeline)
        self.target = target
        self.drafter = drafter
        self.temperature = float(temperature)
        self.top_k, self.top_p = int(top_k), float(top_p)
        self.concurrency = int(concurrency)
        self.refill = max(1, min(int(refill), self.concurrency))
        self.record_rounds = bool(record_rounds)
        self.record_confidence = bool(record_confidence)
        self.max_new_tokens = int(max_new_tokens)
        self.eos = set(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.generator = generator or torch.Generator().manual_seed(int(seed))
        self.progress = progress
        self.desc = desc
        self.device = target.device
        if draft_vocab is not None:
            draft_vocab = check_draft_vocab(draft_vocab, target.vocab_size)
        self.shared = Shared.of(target, draft_vocab)
        self.cost = cost
        self.has_confidence = drafter is not None and drafter.has_confidence
        self.set_policy(policy)
        # (1 / T, b) per position of the confidence logits (None: raw σ(z)), moved to the device once
        self._affine = _affine(calibration, getattr(drafter, "gamma", None))
        self._affine_dev: tuple[Tensor, Tensor] | None = None
        self._clock = _Clock(self.device)
        self._watch: StallWatch | None = None  # set while generate runs
        self._constants: dict[tuple, Tensor] = {}  # ``_constant``

    def set_policy(self, policy: Policy | None = None) -> None:
        """Use ``policy`` for the next ``generate`` (an engine, its caches and graphs, serves many)."""
        policy = Fixed(None) if policy is None else policy
        if self.drafter is not None and policy.needs_confidence and not self.has_confidence:
            raise ValueError(
                f"policy '{policy.name}' needs per-position confidences, but drafter "
                f"'{self.drafter.kind}' has no confidence head: use policy=fixed or "
                f"policy=mtp1, or a DSpark drafter with confidence.enabled=true"
            )
        if self.drafter is not None and policy.needs_cost and self.cost is None:
            raise ValueError(
                f"policy '{policy.name}' needs a cost model (a profiled SPS table): set policy.cost_table"
            )
        self.policy = policy

    @classmethod
    def from_checkpoint(cls, target, drafter_dir: str | Path, policy=None, **kw) -> Engine:
        """Load a saved drafter; its STS temperatures (``calibration.json`` in the folder) apply
        automatically unless ``calibration`` is given."""
        from ..artifacts import DrafterFolder
        from ..checkpoints import load_drafter

        drafter, _ = load_drafter(drafter_dir, target, device=target.device)
        if "calibration" not in kw:
            kw["calibration"] = DrafterFolder(drafter_dir).read_calibration()
        return cls(target, drafter, policy, **kw)

    # ------------------------------------------------------------------------------------------
    def generate(
        self,
        requests: Iterable[Request | Sequence[int]],
        on_result: Callable[[int, Generation], None] | None = None,
    ) -> EngineResult:
        """Decode every request. ``on_result(index, generation)`` is called as each request
        finishes (completion order; ``index`` is its position in ``requests``)."""
        reqs = [r if isinstance(r, Request) else Request(prompt=list(r)) for r in requests]
        for i, r in enumerate(reqs):
            if r.id is None:
                r.id = i
            if len(r.prompt) == 0:
                raise ValueError(f"request {r.id} has an empty prompt")
        self._check_requests(reqs)
        self.policy.reset()
        queue = deque(range(len(reqs)))
        done: dict[int, Generation] = {}
        rounds: list[_RoundRows | None] = []  # records built after the last round
        steps: list[dict] = []
        live: list[_Live] = []
        self._reset_state()
        start = time.perf_counter()
        bar = progress_bar(len(reqs), self.desc, self.progress, unit="req")

        def finished(items: list[_Live]) -> None:
            for item in items:
                gen = Generation(
                    id=item.req.id,
                    prompt_len=len(item.req.prompt),
                    tokens=item.tokens,
                    finish=item.finish,
                    rounds=item.rounds,
                    accepted=item.accepted,
                )
                done[item.index] = gen
                if bar is not None:
                    bar.update(1)
                if on_result is not None:
                    on_result(item.index, gen)

        freeze = gc.get_freeze_count() == 0  # a caller that froze its heap keeps it frozen
        collecting = gc.isenabled()
        if freeze:
            gc.freeze()
        gc.disable()
        try:
            with StallWatch() as self._watch:
                self._rounds_loop(reqs, queue, live, rounds, steps, finished, bar)
        finally:
            self._watch = None
            if collecting:
                gc.enable()
            if freeze:
                gc.unfreeze()
        if bar is not None:
            bar.close()
        self._reset_state()
        return EngineResult(
            generations=[done[i] for i in range(len(reqs))],
            rounds=[rec for rows in rounds if rows is not None for rec in rows.records()],
            steps=steps,
            wall_s=time.perf_counter() - start,
        )

    def _rounds_loop(self, reqs, queue, live, rounds, steps, finished, bar) -> None:
        """Prefill, launch and complete rounds until every request is done (``generate``)."""
        anchors = anchor_pos = None  # [R] long each, on the device
        step = 0
        pending: deque[_Round] = deque()  # launched, their outcomes not read yet, oldest first
        cycle_start = None  # the host's clock when the previous round's completion ended
        rounds_s = 0.0  # of the cycle since: in _launch and _complete
        with torch.inference_mode():  # an on_result that raises leaves state the next run resets
            while queue or live or pending:
                # Requests join behind the round in flight: the device runs their prefill after it
                # (its rows' moves and writes follow that round's in stream order), and nothing of
                # the prefill is read back, so the host goes on to launch the next round at once.
                if queue and len(live) < self.concurrency:
                    take = [queue.popleft() for _ in range(min(self.concurrency - len(live), len(queue)))]
                    new_live, first, pos = self._prefill([reqs[i] for i in take], take, len(live))
                    live += new_live
                    anchors = first if anchors is None else torch.cat([anchors, first])
                    anchor_pos = pos if anchor_pos is None else torch.cat([anchor_pos, pos])
                    finished([item for item in new_live if item.finish is not None])
                    anchors, anchor_pos = self._retire(live, anchors, anchor_pos)
                    self._clock.mark()
                    continue
                # Launch round t, then read round t - p (p = ``pipeline``) while the device runs the
                # rounds after it: the host never waits for a round it has just launched (a request
                # that ended in round t - p rides along in the rounds after it, its tokens
                # discarded). Every round emits a token, so a request as many tokens short of its
                # budget as rounds are in flight surely ends in them: when all do, round t would be
                # void and is not launched; the host reads the oldest round instead.
                launched = None
                ahead = len(pending)
                if any(item.finish is None and not (ahead and item.due(ahead)) for item in live):
                    t0 = time.perf_counter()
                    launched, anchors, anchor_pos = self._launch(live, anchors, anchor_pos, step)
                    rounds_s += time.perf_counter() - t0
                    step += 1
                    pending.append(launched)
                if pending and (len(pending) > self.pipeline or launched is None):
                    t0 = time.perf_counter()
                    recs, ended, info = self._complete(pending.popleft())
                    now = time.perf_counter()
                    if cycle_start is not None:  # the first round's cycle would hold the first prefill
                        info["cycle_ms"] = 1e3 * (now - cycle_start)
                        info["between_ms"] = 1e3 * (t0 - cycle_start - rounds_s)  # outside both calls
                    cycle_start, rounds_s = now, 0.0
                    steps.append(info)
                    rounds.append(recs)
                    finished(ended)
                anchors, anchor_pos = self._retire(live, anchors, anchor_pos)
                if bar is not None and steps:  # τ over the rounds so far, from the steps' sums
                    tokens = sum(s["tokens"] for s in steps[-64:])
                    rows = sum(s["batch"] for s in steps[-64:])
                    bar.set_postfix(tau=f"{tokens / max(rows, 1):.2f}", refresh=False)

    # ---- the caches: the plain path's; ``FastEngine`` overrides these -------------------------
    def _check_requests(self, reqs: list[Request]) -> None:
        """Refuse what cannot run before any work starts (the plain caches grow, so nothing here)."""

    def _reset_state(self) -> None:
        self._kv: RaggedKV | None = None
        self._dcache = None

    def _prefill_forward(self, ids: Tensor, positions: Tensor, lens: Tensor, row0: int, spans: list[int]):
        """Prompts [n, P] (right-padded to P; real lengths ``lens``, ``spans`` on the host) into
        new cache rows row0..row0+n-1. Returns the final hidden state at each prompt's last token
        [n, d] and the tap features [n, P, m·d] for the drafter's context (None without a drafter)."""
        n, width = ids.shape
        kv = RaggedKV.empty(
            self.target.model.config, n, width + self._gamma + 2, self.target.dtype, self.device
        )
        out = self.target(
            ids,
            positions=positions,
            cache=kv,
            attention_mask=kv.plan(width, self.target.dtype),
            with_logits=False,
            use_cache=True,
        )
        kv.commit(lens)
        self._kv = RaggedKV.concat(self._kv, kv)
        return out.last_hidden[torch.arange(n, device=self.device), lens - 1], out.taps

    def _target_step(self, ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Verification forward of ids [R, G+1]: (target probabilities [R, G+1, V], taps)."""
        mask = self._kv.plan(ids.shape[1], self.target.dtype)
        out = self.target(ids, positions=positions, cache=self._kv, attention_mask=mask, use_cache=True)
        return self._target_probs(out.logits), out.taps

    def _commit(self, kept: Tensor, taps: Tensor, positions: Tensor, drafts: Tensor, res) -> None:
        """Keep kept[r] tokens of the last step in row r (the anchor and the accepted drafts) and
        give their features to the drafter, with the token after each (``VerifyResult`` ``res``)."""
        self._kv.commit(kept)
        if self.drafter is not None:
            valid = torch.arange(positions.shape[1], device=self.device)[None, :] < kept[:, None]
            nxt = following_tokens(drafts, res.accepted, res.next_token)
            self.drafter.extend_context(self._dcache, taps, positions, valid, nxt, self.shared)

    def _plain_step(self, ids: Tensor, positions: Tensor) -> tuple[VerifyResult, Tensor | None]:
        """The round that drafted nothing (ids [R, 1]): target-only decoding's step and its token,
        as the verification of no drafts (accepted 0); with the step's taps. Here the target step,
        then ``_verify``; the committed anchors' features reach the drafter in ``_commit`` as in
        any round (``FastEngine`` defers them, and draws the token inside its step)."""
        r = ids.shape[0]
        probs, taps = self._target_step(ids, positions)
        none = self._constant(torch.zeros, r, 0)
        return self._verify(probs, None, none, self._constant(torch.zeros, r), 0), taps

    def _keep_rows(self, index: Tensor, order: list[int]) -> None:
        """Keep rows ``index`` (``order`` on the host: new row i is old row order[i])."""
        self._kv = self._kv.select(index)
        if self._dcache is not None:
            self._dcache = select_draft_cache(self._dcache, index)

    def _propose(self, anchors: Tensor, anchor_pos: Tensor, drafted: int):
        return self.drafter.propose(
            self._dcache, anchors, anchor_pos, self.shared, self.temperature, self.generator,
            draft_len=drafted,
        )  # fmt: skip

    def _verify(self, target_probs, draft_probs, drafts, lengths, drafted: int):
        if draft_probs is None:  # nothing drafted, or a greedy proposal: one-hot at each draft
            draft_probs = self._one_hot_drafts(drafts, target_probs.shape[-1])
        return verify(
            target_probs, draft_probs, drafts, lengths, uniforms=self._verify_uniforms(drafts, drafted),
            draft_index=self._draft_index(draft_probs, target_probs),
        )  # fmt: skip

    def _draft_index(self, draft_probs: Tensor, target_probs: Tensor) -> Tensor | None:
        """How verification reads ``draft_probs``: through the draft vocabulary's columns
        (``Shared.index``) where they are narrower than the target's vocabulary."""
        return self.shared.index if draft_probs.shape[-1] != target_probs.shape[-1] else None

    def _one_hot_drafts(self, drafts: Tensor, vocab: int) -> Tensor:
        """The draft distributions of a proposal that came without any: the empty [R, 0, V] of a
        round that drafted nothing, or a greedy proposal's one-hot rows. At T > 0 drafted tokens
        without distributions cannot be verified losslessly: refused."""
        if drafts.shape[1] and self.temperature > 0:
            raise RuntimeError(
                f"a proposal without draft probabilities at temperature {self.temperature}: only greedy "
                f"(T = 0) proposals may omit them"
            )
        return one_hot_drafts(drafts, vocab)

    def _verify_uniforms(self, drafts: Tensor, drafted: int) -> tuple[Tensor, Tensor]:
        """``u_accept`` is drawn for every drafted position and cut to the verified width, so the
        stream does not depend on how the width was found; then ``u_sample``."""
        r, g = drafts.shape
        if not drafted:  # an empty draw takes nothing from the stream: no pinned copy for it
            return torch.zeros(r, 0, device=self.device), self._uniform(r)
        return self._uniform(r, drafted)[:, :g], self._uniform(r)

    def _target_probs(self, logits: Tensor) -> Tensor:
        return target_probs(logits, self.temperature, self.top_k, self.top_p, static=self._static_sampling)

    # ------------------------------------------------------------------------------------------
    @property
    def _gamma(self) -> int:
        return getattr(self.drafter, "gamma", 0) if self.drafter is not None else 0

    @property
    def _records_confidence(self) -> bool:
        return self.record_rounds and self.record_confidence

    def _constant(self, make: Callable[..., Tensor], *shape: int, dtype=torch.long) -> Tensor:
        """``make(*shape)`` on the device (zeros, ones, an arange), made once per shape
        (``kept_tensor``): a round's fixed inputs cost no launch each round."""
        return kept_tensor(
            self._constants, (make, shape, dtype), lambda: make(*shape, dtype=dtype, device=self.device)
        )

    @property
    def _pinned_draws(self) -> bool:
        """A CPU generator feeding a CUDA device: its draws go through pinned memory and copy
        asynchronously (a pageable copy would wait for the device to drain)."""
        return self.generator.device.type == "cpu" and self.device.type == "cuda"

    def _drawn(self, *shape: int) -> Tensor:
        """``shape`` uniforms from the engine's generator, on the generator's device."""
        if self._pinned_draws:
            return torch.rand(*shape, generator=self.generator, pin_memory=True)
        return torch.rand(*shape, generator=self.generator, device=self.generator.device)

    def _uniform(self, *shape: int) -> Tensor:
        return self._drawn(*shape).to(self.device, non_blocking=self._pinned_draws)

    def _to_device(self, t: Tensor) -> Tensor:
        """A host tensor on the engine's device without waiting for the device (pinned copy)."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _to_host(self, t: Tensor) -> Tensor:
        """Start copying a device tensor to the host; it is read once the round's clock ends."""
        if t.device.type != "cuda":
            return t
        if t.numel() == 0:  # a plain round's empty drafts: nothing to copy
            return torch.empty(t.shape, dtype=t.dtype)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)

    def _to_host_all(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """``_to_host`` of a round's outcome, one pinned buffer and one copy per dtype
        (``packed_copies``): each costs the host a few µs, and a round has five tensors."""
        return packed_copies(tensors, self._to_host) if self.device.type == "cuda" else dict(tensors)

    def _prefill(self, reqs: list[Request], order: list[int], row0: int):
        """Run the new prompts together (right-padded), sample their first token from the target,
        and seed their drafter context with the prompt features. Returns the new live requests,
        their first tokens (the next anchors) and the anchors' positions."""
        n = len(reqs)
        spans = [len(r.prompt) for r in reqs]
        width = max(spans)
        ids = torch.zeros(n, width, dtype=torch.long)  # built on the host, moved once
        for i, r in enumerate(reqs):
            ids[i, : spans[i]] = torch.as_tensor(list(r.prompt), dtype=torch.long)
        # Pinned copies: a pageable one would wait for the device to finish all it was given.
        ids, lens = self._to_device(ids), self._to_device(torch.tensor(spans))
        positions = torch.arange(width, device=self.device).expand(n, -1)
        last, taps = self._prefill_forward(ids, positions, lens, row0, spans)
        rows = torch.arange(n, device=self.device)
        first = sample_from(self._target_probs(self.target.lm_head(last)), self._uniform(n))
        if self.drafter is not None:
            # next_tokens[r, p] = token at p + 1: the prompt shifted left, then the first sampled token.
            nxt = torch.zeros_like(ids)
            nxt[:, :-1] = ids[:, 1:]
            nxt[rows, lens - 1] = first
            self._extend_new_rows(taps, positions, positions < lens[:, None], nxt, row0)
        live = []
        first_host = self._to_host(first)  # read by the next round's completion, not here
        for i, (r, idx) in enumerate(zip(reqs, order)):
            budget = self.max_new_tokens if r.max_new_tokens is None else int(r.max_new_tokens)
            item = _Live(index=idx, req=r, budget=budget, tokens=[])
            if budget > 0:
                item.first = (first_host, i)
            else:
                item.finish = "length"
            live.append(item)
        return live, first, lens.clone()

    def _extend_new_rows(self, taps, positions, valid, next_tokens, row0: int) -> None:
        dcache = self.drafter.new_cache(taps.shape[0], self.device)
        self.drafter.extend_context(dcache, taps, positions, valid, next_tokens, self.shared)
        self._dcache = concat_draft_caches(self._dcache, dcache)

    def _launch(self, live: list[_Live], anchors: Tensor, anchor_pos: Tensor, step: int):
        """Put one round on the device: draft, lengths, target step, verification, commit. Reads
        nothing back (except ``max ℓ`` for a policy whose width depends on the confidences);
        returns the round (its outcome copied to the host asynchronously) and the next anchors
        and their positions, on the device."""
        marks = [time.perf_counter()]  # then the end of each of LAUNCH_PARTS, for the round's record
        readback_s = 0.0

        def mark() -> None:  # the read-back is a wait, not launch work
            marks.append(time.perf_counter() - readback_s)

        self._clock.launch()
        r = len(live)
        device = self.device
        drafted = 0
        policy_s = 0.0
        plan = None
        if self.drafter is not None:
            tp = time.perf_counter()
            drafted = max(0, min(int(self.policy.draft_length(r, self._gamma, self.cost)), self._gamma))
            plan = self.policy.plan_record()
            policy_s = time.perf_counter() - tp
        mark()
        conf_logits = conf = shadow = None
        if drafted:
            prop = self._propose(anchors, anchor_pos, drafted)
            mark()
            if prop.confidence_logits is not None:
                conf_logits = prop.confidence_logits.float()
                if self.policy.reads_confidences() or self._records_confidence:
                    conf = self._calibrated(conf_logits)
            # A policy that reads no confidences this round gets a tensor of their shape; one that
            # needs them has a drafter that gives them (``set_policy``).
            scores = conf if conf is not None else conf_logits
            if scores is None:
                scores = self._constant(torch.ones, r, drafted, dtype=torch.float32)
            tp = time.perf_counter()
            lengths = (
                self.policy.lengths(scores, self.cost).to(device=device, dtype=torch.long).clamp(0, drafted)
            )
            shadow = self.policy.shadow_inputs(scores, self.cost)  # read back with the outcome, unused here
            g = self.policy.width(drafted)
            policy_s += time.perf_counter() - tp
            if g is None:
                t1 = time.perf_counter()
                g = int(lengths.max())  # the one read-back of a confidence-dependent width
                readback_s = time.perf_counter() - t1
            drafts = prop.tokens[:, :g]
            draft_probs = None if prop.probs is None else prop.probs[:, :g]  # None: a greedy proposal
        else:
            marks.append(marks[-1])  # no draft step
            g = 0
            lengths, drafts = self._constant(torch.zeros, r), self._constant(torch.zeros, r, 0)
            draft_probs = None
        mark()
        # What the target step returns is what ``_verify`` reads: probabilities [R, G+1, V] here,
        # the argmax tokens [R, G+1] in the fast engine's greedy rounds.
        if drafted:
            ids = torch.cat([anchors[:, None], drafts], dim=1)  # [R, G+1]; drafts past ℓ_r are padding
            positions = anchor_pos[:, None] + self._constant(torch.arange, g + 1)
            target_out, taps = self._target_step(ids, positions)
            mark()
            res = self._verify(target_out, draft_probs, drafts, lengths, drafted)
            kept = res.accepted + 1
        else:  # nothing drafted: target-only decoding's step, which also chooses the next token
            # Its inputs are views and every row keeps one token: no launch for either (each one
            # costs the host tens of µs, and a plain round's host work sets the pace at a high load).
            ids, positions = anchors[:, None], anchor_pos[:, None]
            res, taps = self._plain_step(ids, positions)
            kept = self._constant(torch.ones, r)
            mark()
        mark()
        n = res.accepted
        # Rows of finished requests (waiting for ``refill``) keep nothing and their anchor: they
        # stay in place, re-verifying the same position until they leave.
        next_anchors = res.next_token
        idle = [item.finish is not None for item in live]
        if any(idle):
            mask = self._to_device(torch.tensor(idle))
            kept = torch.where(mask, 0, kept)
            next_anchors = torch.where(mask, anchors, next_anchors)
        self._commit(kept, taps, positions, drafts, res)  # the rest is overwritten next round
        mark()
        out = {"accepted": n, "next": res.next_token, "lengths": lengths, "drafts": drafts, "pos": anchor_pos}
        if self._records_confidence and conf_logits is not None:
            out.update(conf_logits=conf_logits, conf=conf)
        if shadow is not None:
            out["shadow"] = shadow
        next_pos = anchor_pos + kept
        copies = self._to_host_all(out)
        stamp = self._clock.end()  # after the copies: reading them waits for this event
        mark()
        rnd = _Round(step, list(live), drafted, copies, stamp, tuple(marks), readback_s, policy_s, plan)
        return rnd, next_anchors, next_pos

    def _complete(self, rnd: _Round) -> tuple[_RoundRows | None, list[_Live], dict]:
        """The host side of a launched round, once its outcome is on the host: emit tokens, end
        requests at EOS or budget, keep what its records need (``_RoundRows``), tell the policy."""
        t0 = time.perf_counter()
        timing = self._clock.read(rnd.stamp)  # waits for the round's copies
        t1 = time.perf_counter()
        host = {k: v.tolist() for k, v in rnd.out.items() if k != "shadow"}  # the policy reads that one
        n_l, next_l, len_l, draft_l = host["accepted"], host["next"], host["lengths"], host["drafts"]
        kept, ended, rows = [], [], []
        eos, record = self.eos, self.record_rounds
        # R rows a round: at a high load these loops are most of the host's work for it
        if rnd.drafted:
            for i, item in enumerate(rnd.items):
                if item.first is not None:  # joined before this round: its prefill's token comes first
                    self._emit_first(item, ended)
                if item.finish is not None:  # ended before this round's tokens: they are void
                    continue
                rows.append(i)
                n = n_l[i]
                new = draft_l[i][:n]  # a fresh list: the accepted drafts, then the new token
                new.append(next_l[i])
                if n + 1 < item.budget - len(item.tokens) and eos.isdisjoint(new):  # the request goes on
                    item.tokens += new  # no test per token
                    emitted = n + 1
                else:
                    emitted = self._emit(item, new)
                    if item.finish is not None:
                        ended.append(item)
                if record:
                    kept.append((i, item.req.id, item.rounds, emitted))
                item.rounds += 1
                item.accepted += n
            tokens = sum(n_l[i] + 1 for i in rows)
        else:  # nothing drafted: each live row gets its next token (the loop above, made lean: a
            # third less host time at R = 256 on a CPU)
            for i, (item, tok) in enumerate(zip(rnd.items, next_l)):
                if item.first is not None:
                    self._emit_first(item, ended)
                if item.finish is not None:
                    continue
                rows.append(i)
                if len(item.tokens) + 1 < item.budget and tok not in eos:
                    item.tokens.append(tok)
                else:  # its last token: kept, then the request ends
                    self._emit(item, [tok])
                    ended.append(item)
                if record:
                    kept.append((i, item.req.id, item.rounds, 1))
                item.rounds += 1
            tokens = len(rows)
        batch = len(rows)  # the round's live rows
        recs = _RoundRows(rnd.step, batch, self._gamma, host, kept) if self.record_rounds else None
        policy_s = rnd.policy_s
        if self.drafter is not None:
            tp = time.perf_counter()
            # The host copies of the live rows: all of them at a steady load, and no index then (one
            # built from R = 256 row numbers and applied took 7 of the ~33 µs of a plain round's
            # policy work on a CPU).
            live = slice(None) if batch == len(rnd.items) else np.asarray(rows, dtype=np.int64)
            self.policy.observe_round(rnd.out["lengths"].numpy()[live], rnd.out["accepted"].numpy()[live])
            if "shadow" in rnd.out:
                self.policy.observe_shadow(rnd.out["shadow"].numpy()[live])
            policy_s += time.perf_counter() - tp
        wait_s = t1 - t0
        host_ms = 1e3 * (rnd.launch_s + time.perf_counter() - t1)
        info = {
            "step": rnd.step,
            "batch": batch,
            "drafted": rnd.drafted,
            "verified": len(rnd.items) + sum(len_l),
            "tokens": tokens,
            "ms": timing.get("ms", 1e3 * (rnd.launch_s + rnd.readback_s + time.perf_counter() - t0)),
            "host_ms": host_ms,
            "launch_ms": 1e3 * rnd.launch_s,  # of host_ms: putting the round on the device
            "policy_ms": 1e3 * policy_s,  # of host_ms: the policy's calls, in both halves
            "wait_ms": 1e3 * wait_s,
            "readback_ms": 1e3 * rnd.readback_s,
            "launch_parts": launch_parts(rnd.marks),  # launch_ms by part
            "gpu_ms": timing.get("gpu_ms"),
            # one-off work since the previous round's record (graph captures, compiles, GC passes)
            "events": self._watch.increments() if self._watch is not None else {},
        }
        if rnd.plan is not None:
            info["plan"] = rnd.plan
        if self.drafter is not None and not info["events"]:
            # A round that met one-off work (a graph captured, a frame compiled, a GC pass, the
            # allocator grown) timed that work too: the policies' clocks, which keep a decaying
            # mean per kind of round, would carry it for many rounds of that kind.
            self.policy.observe_time(info["ms"])
        return recs, ended, info

    def _calibrated(self, z: Tensor) -> Tensor:
        """σ(z_k / T_k + b_k) of the drafted positions (the first ``z.shape[1]`` of the block; b = 0
        for STS), one fused multiply-add before the sigmoid."""
        if self._affine is None:
            return torch.sigmoid(z)
        if self._affine_dev is None:
            self._affine_dev = tuple(self._to_device(t) for t in self._affine)
        if self._affine[0].numel() < z.shape[1]:
            raise ValueError(
                f"calibration has {self._affine[0].numel()} temperatures, the drafter proposes "
                f"{z.shape[1]} tokens"
            )
        scale, offset = (t[: z.shape[1]].to(z.dtype) for t in self._affine_dev)
        return torch.sigmoid(torch.addcmul(offset, z, scale))

    def _emit_first(self, item: _Live, ended: list[_Live]) -> None:
        """The first token of a request that joined before this round (its prefill's), emitted
        before the round's own."""
        copy, j = item.first
        item.first = None
        self._emit(item, [int(copy[j])])
        if item.finish is not None:
            ended.append(item)

    def _emit(self, item: _Live, new: list[int]) -> int:
        """Append tokens until EOS or the budget, token by token; returns how many were kept.
        (``_complete`` appends a round's tokens at once where neither can stop them.)"""
        kept = 0
        for tok in new:
            item.tokens.append(tok)
            kept += 1
            if tok in self.eos:
                item.finish = "eos"
                break
            if len(item.tokens) >= item.budget:
                item.finish = "length"
                break
        return kept

    def _retire(self, live: list[_Live], anchors, anchor_pos):
        """Drop finished requests from the batch (both caches, anchors) once ``refill`` of them
        (or all) are finished. The running rows past the new batch size fill the finished rows'
        places, in order; the others stay where they are (a cache row moves only if it must)."""
        keep = [i for i, item in enumerate(live) if item.finish is None]
        idle = len(live) - len(keep)
        if idle == 0 or (idle < self.refill and keep):
            return anchors, anchor_pos
        order = retire_order([item.finish is None for item in live])
        live[:] = [live[i] for i in order]
        index = self._to_device(torch.tensor(order, dtype=torch.long))
        self._keep_rows(index, order)
        return anchors[index], anchor_pos[index]


def retire_order(running: Sequence[bool]) -> list[int]:
    """The rows that stay, as the new row order: rows below the new batch size ``n`` (the running
    count) keep their place when running; each finished one takes the next running row from
    above ``n``. ``order[i]`` is the old row of new row ``i``."""
    n = sum(running)
    order = list(range(n))
    holes = (i for i in range(n) if not running[i])
    for hole, above in zip(holes, (i for i in range(n, len(running)) if running[i])):
        order[hole] = above
    return order


def following_tokens(drafts: Tensor, accepted: Tensor, next_token: Tensor) -> Tensor:
    """[R, G + 1]: the token after each verified position a..a+G of a round: d_1..d_n (the accepted
    drafts), then the new token at n (past it: padding, never kept)."""
    nxt = torch.cat([drafts, torch.zeros_like(next_token)[:, None]], dim=1)
    nxt[torch.arange(nxt.shape[0], device=nxt.device), accepted] = next_token
    return nxt


def _affine(calibration, gamma: int | None) -> tuple[Tensor, Tensor] | None:
    """(1 / T_k, b_k) as float32 tensors of ``calibration`` (``Calibration.of`` reads it: b = 0 for
    STS), checked against the drafter's γ; None without one."""
    cal = Calibration.of(calibration)
    if cal is None:
        return None
    if gamma is not None and len(cal.temperatures) != gamma:
        raise ValueError(
            f"calibration has {len(cal.temperatures)} temperatures, but the drafter proposes "
            f"gamma={gamma} tokens"
        )
    temps = torch.tensor(cal.temperatures, dtype=torch.float32)
    return 1.0 / temps, torch.tensor(cal.biases, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Statistics over round records (RoundRecord objects or the dicts of rounds.jsonl)


def _get(rec, key):
    return rec[key] if isinstance(rec, dict) else getattr(rec, key)


def _whole_blocks(records: Iterable) -> list:
    """The rounds that carry confidences for the whole block (a round that drafted fewer
    positions, or none, says nothing about the rest)."""
    recs = [r for r in records if _get(r, "confidence_logits") is not None]
    gamma = max((len(_get(r, "confidence_logits")) for r in recs), default=0)
    return [r for r in recs if len(_get(r, "confidence_logits")) == gamma]


def tau(records: Iterable) -> float | None:
    """Mean accepted + 1 per round (None without rounds)."""
    recs = list(records)
    return sum(_get(r, "accepted") + 1 for r in recs) / len(recs) if recs else None


def conditional_acceptance(records: Iterable, gamma: int) -> list[float | None]:
    """Paper Fig. 2: at draft position k, among rounds that verified position k with positions
    1..k-1 all accepted, the fraction where k was accepted too (None where no round qualifies)."""
    per_request = per_request_positions(records, gamma).values()
    num = [sum(a[k] for a, _ in per_request) for k in range(gamma)]
    den = [sum(r[k] for _, r in per_request) for k in range(gamma)]
    return [num[k] / den[k] if den[k] else None for k in range(gamma)]


def calibration_arrays(records: Iterable) -> tuple[Tensor, Tensor, Tensor]:
    """(confidence logits [N, γ], prefix-acceptance labels y_k = 1[n >= k], valid = k <= ℓ) from the
    rounds that carry confidence logits: the rollout input of ``calibration.sts.fit_sts``."""
    z, n, ell = [], [], []
    for r in _whole_blocks(records):
        z.append(_get(r, "confidence_logits"))
        n.append(_get(r, "accepted"))
        ell.append(_get(r, "proposed"))
    if not z:
        raise ValueError("no round carries confidence logits (the drafter has no confidence head)")
    logits = torch.tensor(z, dtype=torch.float32)
    k = torch.arange(1, logits.shape[1] + 1)
    labels = (torch.tensor(n)[:, None] >= k).float()
    valid = torch.tensor(ell)[:, None] >= k
    return logits, labels, valid


def threshold_sweep(records: Iterable, thresholds: Sequence[float], calibrated: bool = True) -> list[dict]:
    """Paper Fig. 5, offline: for each threshold t, verify only the longest prefix whose cumulative
    confidence Π c_i stays >= t (what the threshold policy would do) and count its accepted and
    rejected draft tokens. Exact from recorded rounds because acceptance of position k does not
    depend on how many positions follow it; rounds are cut at their recorded ℓ (a fixed-γ run
    records the full block). ``calibrated`` uses σ(z/T) as recorded, else raw σ(z)."""
    recs = _whole_blocks(records)
    if not recs:
        raise ValueError("no round carries confidences: the threshold sweep needs a confidence head")
    if calibrated:
        c = torch.tensor([_get(r, "confidence") for r in recs], dtype=torch.float64)
    else:
        c = torch.sigmoid(torch.tensor([_get(r, "confidence_logits") for r in recs], dtype=torch.float64))
    a = torch.cumprod(c, dim=1)
    n = torch.tensor([_get(r, "accepted") for r in recs])
    ell = torch.tensor([_get(r, "proposed") for r in recs])
    rows = []
    for t in thresholds:
        lt = torch.minimum(torch.cumprod((a >= t).long(), dim=1).sum(1), ell)
        acc = torch.minimum(n, lt)
        verified = int(lt.sum())
        rows.append(
            {
                "threshold": float(t),
                "accepted_per_step": float(acc.float().mean()),
                "rejected_per_step": float((lt - acc).float().mean()),
                "tokens_per_step": float(lt.float().mean()),
                "acceptance_rate": float(acc.sum()) / verified if verified else None,
                "tau": float((acc + 1).float().mean()),
                "rounds": len(recs),
            }
        )
    return rows
