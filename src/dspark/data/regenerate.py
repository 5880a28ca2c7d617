"""The target answers each prompt: batched sampling, written in resumable shards.

Shard k of a split holds the conversations of prompts [k*N, (k+1)*N) of that split's fixed prompt
list and is written atomically, so after an interruption every shard on disk is complete; a rerun
checks that each finished shard holds exactly its expected ids, skips it, and answers only the
prompts of the other shards: no sample is lost or written twice.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..core.errors import DataError
from ..core.io import atomic_write_jsonl, read_jsonl
from .io import stable_hash
from .tokenize import prompt_ids

log = logging.getLogger(__name__)


@dataclass
class Continuation:
    tokens: list[int]  # generated tokens, stop token excluded
    finished: bool  # True when the target stopped by itself (an eos), False when max_new_tokens cut it


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 192

    @classmethod
    def from_config(cls, generation, max_new_tokens: int | None = None) -> Sampling:
        g = dict(generation or {})
        return cls(
            temperature=float(g.get("temperature", 1.0)),
            top_p=float(g.get("top_p", 1.0) or 1.0),
            top_k=int(g.get("top_k", 0) or 0),
            max_new_tokens=int(max_new_tokens or g.get("max_new_tokens", 192)),
        )

    def generate_kwargs(self) -> dict:
        if self.temperature <= 0:
            return {"do_sample": False}
        # top_k=0 disables the filter explicitly (None would let transformers apply its default of 50).
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),
        }


def cpu_threads(setting: object = "auto") -> int:
    """Torch threads for CPU generation. "auto": one per core not already busy (one-minute load
    average), at least one: on a shared box, OpenMP threads beyond the free cores spin against the
    other jobs and decoding runs several times slower (measured 6x on 2 busy cores)."""
    cores = os.cpu_count() or 1
    if setting in (None, "auto"):
        busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        return max(1, min(torch.get_num_threads(), cores - int(round(busy))))
    return max(1, int(setting))


class ThreadGovernor:
    """Keeps torch's CPU thread count at `cpu_threads("auto")` while a long generation runs, so it
    takes the second core back when the other jobs finish (and yields it when they return).
    `tick()` is cheap; it re-reads the load average at most every `period` seconds."""

    def __init__(self, setting: object = "auto", period: float = 30.0):
        self.auto = setting in (None, "auto")
        self.ceiling = torch.get_num_threads()
        self.period = period
        self.last = time.monotonic()
        torch.set_num_threads(cpu_threads(setting))

    def tick(self) -> None:
        now = time.monotonic()
        if not self.auto or now - self.last < self.period or not hasattr(os, "getloadavg"):
            return
        self.last = now
        ours = torch.get_num_threads()
        others = max(0.0, os.getloadavg()[0] - ours)  # the load average counts our own threads too
        want = max(1, min(self.ceiling, (os.cpu_count() or 1) - int(round(others))))
        if want != ours:
            torch.set_num_threads(want)
            log.info("CPU threads %d -> %d (load average %.1f)", ours, want, os.getloadavg()[0])


def _pad_id(target) -> int:
    tok = target.tokenizer
    return int(tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0])


# Candidate widths tried before a full-vocabulary sort: a row whose nucleus ends inside the top w
# tokens is exact already, so only the flat rows pay for a wider search (the sort of 49k logits per
# row dominated CPU sampling at temperature 1).
_NUCLEUS_WIDTHS = (512, 4096)


def nucleus(probs: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p filtering of probabilities [n, V], as transformers' warpers do it (top-p on the
    distribution renormalised over the top-k set; a token is kept while the mass before it < top_p).
    Returns unnormalised kept weights and their token ids, [n, K] each (zero weight = dropped)."""
    n, V = probs.shape
    k = top_k if 0 < top_k < V else V
    if top_p >= 1.0 and k == V:
        return probs, torch.arange(V, device=probs.device).expand_as(probs)
    widths = [w for w in _NUCLEUS_WIDTHS if w < k] + [k]
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, vals, ids)
    todo = torch.arange(n, device=probs.device)
    for w in widths:
        sub = probs[todo]
        vals, ids = sub.topk(w, dim=-1) if w < V else sub.sort(dim=-1, descending=True)
        # A narrower search is exact when no top-k renormalisation is needed and it holds top_p mass.
        done = (
            vals.sum(-1) >= top_p if (w < k and k == V) else torch.full_like(todo, w == k, dtype=torch.bool)
        )
        if bool(done.any()):
            found.append((todo[done], vals[done], ids[done]))
            todo = todo[~done]
        if len(todo) == 0:
            break
    width = max(v.shape[1] for _, v, _ in found)
    vals = probs.new_zeros(n, width)
    ids = torch.zeros(n, width, dtype=torch.long, device=probs.device)
    for rows, v, i in found:
        vals[rows, : v.shape[1]], ids[rows, : i.shape[1]] = v, i
    if top_p < 1.0:
        dist = vals / vals.sum(-1, keepdim=True)  # renormalised over the top-k set
        keep = (dist.cumsum(-1) - dist) < top_p
        keep[:, 0] = True
        vals = vals * keep
    return vals, ids


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of float logits [n, V]: greedy at temperature 0, else temperature, top-k, top-p."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    weights, ids = nucleus(probs, sampling.top_k, sampling.top_p)
    choice = torch.multinomial(weights, 1, generator=generator)
    return ids.gather(-1, choice).squeeze(-1)


def _left_pad(prefixes: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prefixes)
    ids = torch.full((len(prefixes), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prefixes), width), dtype=torch.long)
    for row, p in enumerate(prefixes):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[row, width - len(p) :] = 1
    return ids.to(device), attn.to(device)


class _GrowingLayer:
    """Mixin for a transformers DynamicLayer: append new keys/values into spare capacity (doubled when
    exhausted) instead of `torch.cat`-ing the whole cache at every step. At batch 64 that per-step copy
    and its page faults cost more than the matmuls on CPU. `keys`/`values` stay views of the buffer;
    anything that replaces them (row selection, cropping) simply triggers a fresh buffer."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        held = self.keys.dim() == 4
        length = self.keys.shape[-2] if held else 0
        buf = getattr(self, "_buf", None)
        if (
            buf is None
            or not held
            or self.keys.data_ptr() != buf[0].data_ptr()
            or self.keys.shape[:2] != buf[0].shape[:2]
            or self.keys.stride() != buf[0].stride()
            or length + n > buf[0].shape[2]
        ):
            cap = length + n + max(64, (length + n) // 4)  # 25% headroom: bounded memory, rare copies
            shape = (*key_states.shape[:2], cap, key_states.shape[-1])
            buf = (key_states.new_empty(shape), value_states.new_empty(shape))
            if length:
                buf[0][:, :, :length], buf[1][:, :, :length] = self.keys, self.values
            self._buf = buf
        buf[0][:, :, length : length + n] = key_states
        buf[1][:, :, length : length + n] = value_states
        self.keys, self.values = buf[0][:, :, : length + n], buf[1][:, :, : length + n]
        return self.keys, self.values


@functools.cache
def _growing_class() -> type:
    from transformers.cache_utils import DynamicLayer

    return type("GrowingDynamicLayer", (_GrowingLayer, DynamicLayer), {})


def _grown(layer):
    """The same layer with in-place appends (a plain DynamicLayer only; sliding windows are left alone)."""
    from transformers.cache_utils import DynamicLayer

    return _growing_class()() if type(layer) is DynamicLayer else layer


def gqa_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA for one decoding step without materialising repeated KV heads. transformers' SDPA path
    copies every KV head n_rep times whenever a padding mask is present (`repeat_kv`), which at batch
    64 is most of the step's time on CPU. With one query token, the n_rep query heads that share a
    KV head are folded into the query axis instead: exact, and each KV head is read once."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n_rep = int(getattr(module, "num_key_value_groups", 1))
    B, H, q, D = query.shape
    plain = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    if (
        n_rep == 1
        or q != 1
        or not plain
        or kwargs.get("position_bias") is not None
        or key.shape[1] * n_rep != H
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # repeat_kv maps query head h to KV head h // n_rep: viewing query as [B, Hkv, n_rep, D] is that grouping.
    folded = query.reshape(B, key.shape[1], n_rep, D)
    mask = attention_mask
    if mask is not None:
        mask = mask.expand(B, 1, n_rep, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


_ATTN_NAME = "dspark_gqa_decode"


@contextlib.contextmanager
def fast_decoding(model):
    """Run `model` with `gqa_decode_attention` (registered once under its own name, with the SDPA mask
    builder) and restore its attention implementation afterwards; models that refuse it run as is."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_ATTN_NAME, gqa_decode_attention)
    AttentionMaskInterface.register(_ATTN_NAME, sdpa_mask)
    before = model.config._attn_implementation
    try:
        if before == "sdpa":
            model.set_attn_implementation(_ATTN_NAME)
    except (ValueError, ImportError, AttributeError) as err:  # an architecture without attention dispatch
        log.debug("fast decoding attention unavailable: %s", err)
    try:
        yield
    finally:
        if model.config._attn_implementation != before:
            model.set_attn_implementation(before)


class _Batch:
    """The running rows of `decode_stream`: KV cache, 2-D attention mask, next positions, last logits."""

    def __init__(self, model, rows: list[int], ids: torch.Tensor, attn: torch.Tensor):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.cache.layers = [_grown(layer) for layer in self.cache.layers]
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.logits = out.logits[:, -1].float()
        self.attn, self.pos, self.rows = attn, pos[:, -1] + 1, list(rows)
        # Rows can join a running batch only when every layer is a plain growing cache (not sliding windows).
        self.mergeable = all(
            isinstance(layer, _GrowingLayer) or type(layer) is DynamicLayer for layer in self.cache.layers
        )

    def __len__(self) -> int:
        return len(self.rows)

    def keep(self, sel: torch.Tensor) -> None:
        self.cache.reorder_cache(sel)
        self.attn, self.pos, self.logits = self.attn[sel], self.pos[sel], self.logits[sel]
        self.rows = [self.rows[i] for i in sel.tolist()]  # None marks a stopped row
        # Drop leading columns that are padding for every remaining row (the cache would only grow).
        first = int(self.attn.any(0).nonzero()[0])
        if first > 0 and self.mergeable:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.attn = self.attn[:, first:]

    def merge(self, other: _Batch) -> None:
        """Append other's rows, left-padding the shorter cache (padding is masked out)."""
        a, b = self.attn.shape[1], other.attn.shape[1]
        if a < b:
            self._pad_left(b - a)
        elif b < a:
            other._pad_left(a - b)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        self.attn = torch.cat([self.attn, other.attn])
        self.pos = torch.cat([self.pos, other.pos])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows += other.rows

    def _pad_left(self, n: int) -> None:
        for layer in self.cache.layers:
            k, v = layer.keys, layer.values
            layer.keys = torch.cat([k.new_zeros(*k.shape[:2], n, k.shape[3]), k], dim=2)
            layer.values = torch.cat([v.new_zeros(*v.shape[:2], n, v.shape[3]), v], dim=2)
        self.attn = torch.cat([self.attn.new_zeros(len(self.attn), n), self.attn], dim=1)

    def step(self, tokens: torch.Tensor) -> None:
        self.attn = torch.cat([self.attn, self.attn.new_ones(len(self.attn), 1)], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.attn,
            position_ids=self.pos[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.logits = out.logits[:, -1].float()
        self.pos = self.pos + 1


@torch.no_grad()
def decode_stream(
    model,
    prefixes: Sequence[Sequence[int]],
    limits: Sequence[int],
    sampling: Sampling,
    eos: Sequence[int],
    pad: int,
    batch_size: int,
    generator: torch.Generator | None,
    on_result: Callable[[int, Continuation], None],
    on_step: Callable[[], None] | None = None,
) -> None:
    """Continuous batching with a KV cache: queued prefixes take the slots of rows that stopped (a
    stop token, or their limit), so the batch stays full and short answers never wait for long ones.
    Stopped rows are dropped lazily, once a quarter of the batch has stopped: dropping rows and
    admitting new ones both copy the whole cache, which per finished row would cost more than the
    idle rows do. Results arrive through `on_result(index, continuation)`, in completion order."""
    device = next(model.parameters()).device
    stop = torch.tensor(sorted(set(eos)), device=device)
    queue = deque(range(len(prefixes)))
    tokens: dict[int, list[int]] = {}
    batch: _Batch | None = None
    while queue or batch is not None:
        if batch is not None:
            alive = [r for r, i in enumerate(batch.rows) if i is not None]
            if not alive:
                batch = None
            elif len(batch) - len(alive) >= max(1, len(batch) // 4):
                batch.keep(torch.tensor(alive, device=device))
        free = batch_size - (len(batch) if batch else 0)
        can_join = batch is None or (batch.mergeable and free >= max(1, batch_size // 4))
        if queue and free > 0 and can_join:
            new = [queue.popleft() for _ in range(min(free, len(queue)))]
            ids, attn = _left_pad([list(prefixes[i]) for i in new], pad, device)
            fresh = _Batch(model, new, ids, attn)
            for i in new:
                tokens[i] = []
            if batch is None:
                batch = fresh
            else:
                batch.merge(fresh)
        if batch is None:
            continue
        nxt = sample_next(batch.logits, sampling, generator)
        is_stop = torch.isin(nxt, stop).tolist()
        for r, (i, t) in enumerate(zip(batch.rows, nxt.tolist())):
            if i is None:  # a stopped row waiting to be dropped
                continue
            if is_stop[r]:
                on_result(i, Continuation(tokens.pop(i), True))
                batch.rows[r] = None
                continue
            tokens[i].append(t)
            if len(tokens[i]) >= limits[i]:
                on_result(i, Continuation(tokens.pop(i), False))
                batch.rows[r] = None
        if any(i is not None for i in batch.rows):
            batch.step(nxt)
        if on_step:
            on_step()


@torch.no_grad()
def generate_continuations(
    target,
    prefixes: Sequence[Sequence[int]],
    sampling: Sampling,
    *,
    batch_size: int,
    seed: object,
    max_new_tokens: Sequence[int] | None = None,
    on_result: Callable[[int, Continuation], None] | None = None,
    on_step: Callable[[], None] | None = None,
    backend: str = "loop",
) -> list[Continuation]:
    """Sample a continuation of every prefix from the target, with per-prefix token limits.

    backend "loop" (default) is `decode_stream`: continuous batching, several times less padding
    and idle rows than static batches on CPU. "hf" is the model's own `generate` on left-padded
    static batches (sorted by length), the reference implementation of the same distribution.
    Sampling uses a generator seeded from `seed` alone (no global RNG), so a call is reproducible.
    `on_result(index, continuation)` fires as each continuation completes (progress, shard writes)."""
    if backend not in ("loop", "hf"):
        raise DataError(f"generation backend '{backend}' is not 'loop' or 'hf'")
    model, pad, eos = target.model, _pad_id(target), list(target.eos_token_ids)
    device = target.device
    limits = [sampling.max_new_tokens] * len(prefixes)
    if max_new_tokens is not None:
        limits = [max(1, min(sampling.max_new_tokens, int(m))) for m in max_new_tokens]
    out: list[Continuation | None] = [None] * len(prefixes)

    def record(i: int, c: Continuation) -> None:
        out[i] = c
        if on_result:
            on_result(i, c)

    if backend == "loop":
        gen = torch.Generator(device=device).manual_seed(int(stable_hash(seed, 15), 16))
        with fast_decoding(model):
            decode_stream(model, prefixes, limits, sampling, eos, pad, batch_size, gen, record, on_step)
        return out  # type: ignore[return-value]
    order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))
    for b, start in enumerate(range(0, len(order), batch_size)):
        idx = order[start : start + batch_size]
        ids, attn = _left_pad([list(prefixes[i]) for i in idx], pad, device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(int(stable_hash([seed, b], 15), 16))
            seqs = model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=min(limits[i] for i in idx),
                eos_token_id=eos,
                pad_token_id=pad,
                **sampling.generate_kwargs(),
            )
        for i, toks in zip(idx, seqs[:, ids.shape[1] :].tolist()):
            cut = next((k for k, t in enumerate(toks) if t in eos), None)
            record(i, Continuation(toks[:cut] if cut is not None else toks, cut is not None))
    return out  # type: ignore[return-value]


def decode(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()


def conversation_messages(prompt: dict) -> list[dict]:
    msgs = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
    return msgs + [{"role": "user", "content": prompt["prompt"]}]


def shard_path(folder: Path, split: str, k: int) -> Path:
    return folder / f"{split}-{k:05d}.jsonl"


@dataclass
class RegenStats:
    conversations: int = 0
    skipped_shards: int = 0
    written_shards: int = 0
    answer_tokens: int = 0
    finished: int = 0
    cut_at_max_new_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["conversations_per_min"] = (
            round(60 * self.conversations / self.seconds, 2) if self.seconds else None
        )
        d["answer_tokens_per_s"] = round(self.answer_tokens / self.seconds, 2) if self.seconds else None
        return d


def _finished_shards(out_dir: Path, split: str, shards: list[list[dict]]) -> list[int]:
    done = []
    for k, shard in enumerate(shards):
        path = shard_path(out_dir, split, k)
        if path.exists():
            if [r["id"] for r in read_jsonl(path)] != [p["id"] for p in shard]:
                raise DataError(
                    f"{path} holds other prompts than this run would write there (a different prompt list "
                    f"or shard_size): refusing to mix runs. Delete {out_dir} or use a fresh data.dir."
                )
            done.append(k)
    return done


def regenerate(
    target,
    splits: dict[str, list[dict]],
    out_dir: str | Path,
    sampling: Sampling,
    *,
    shard_size: int,
    batch_size: int,
    seed: int,
    max_length: int,
    chat_kwargs: dict | None = None,
    backend: str = "loop",
    write_rows: Callable[[Path, list[dict]], None] = atomic_write_jsonl,
    on_step: Callable[[], None] | None = None,
) -> tuple[dict[str, RegenStats], RegenStats]:
    """Answer every prompt of every split into `out_dir/<split>-NNNNN.jsonl`.

    Finished shards are skipped (after checking they hold exactly the expected prompt ids); the
    prompts of all other shards, of all splits, stream through one generation pass (one batch
    tail instead of one per split), and each shard is written the moment its last answer arrives.
    Returns per-split counts and the totals (with the wall time of the pass)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    stats = {split: RegenStats() for split in splits}
    total = RegenStats()
    shards = {s: [ps[i : i + shard_size] for i in range(0, len(ps), shard_size)] for s, ps in splits.items()}
    work: list[tuple[str, int, int]] = []  # (split, shard, position in shard) of every prompt still to answer
    for split, sh in shards.items():
        done = set(_finished_shards(out_dir, split, sh))
        stats[split].skipped_shards = total.skipped_shards = len(done)
        if done:
            log.info(
                "%s: %d finished shard(s) found, resuming with %d", split, len(done), len(sh) - len(done)
            )
        work += [(split, k, j) for k in range(len(sh)) if k not in done for j in range(len(sh[k]))]
    total.skipped_shards = sum(s.skipped_shards for s in stats.values())
    if not work:
        return stats, total
    prefixes = [prompt_ids(tok, conversation_messages(shards[s][k][j]), chat_kwargs) for s, k, j in work]
    room = [max(1, max_length - len(p)) for p in prefixes]  # tokens past max_length would be cut anyway
    pending = {(s, k): [None] * len(shards[s][k]) for s, k, _ in work}
    missing = {key: len(rows) for key, rows in pending.items()}
    start = time.perf_counter()
    bar = tqdm(total=len(work), desc=f"answering ({'+'.join(splits)})", unit="conv")

    def on_result(i: int, c: Continuation) -> None:
        split, k, j = work[i]
        p = shards[split][k][j]
        answer = decode(tok, c.tokens)
        pending[(split, k)][j] = {
            "id": p["id"],
            "split": split,
            "domain": p.get("domain"),
            "source": p.get("source"),
            "messages": conversation_messages(p) + [{"role": "assistant", "content": answer}],
            "finish": "stop" if c.finished else "length",
            "answer_tokens": len(c.tokens),
        }
        for st in (stats[split], total):
            st.answer_tokens += len(c.tokens) + c.finished
            st.finished += c.finished
            st.cut_at_max_new_tokens += not c.finished
        missing[(split, k)] -= 1
        if missing[(split, k)] == 0:  # the shard is complete: write it now (atomically), a crash loses little
            write_rows(shard_path(out_dir, split, k), pending.pop((split, k)))
            for st in (stats[split], total):
                st.written_shards += 1
                st.conversations += len(shards[split][k])
        bar.update(1)
        bar.set_postfix(tok_s=f"{total.answer_tokens / max(time.perf_counter() - start, 1e-9):.0f}")

    try:
        generate_continuations(
            target,
            prefixes,
            sampling,
            batch_size=batch_size,
            seed=[seed, sorted({(s, k) for s, k, _ in work})],
            max_new_tokens=room,
            on_result=on_result,
            on_step=on_step,
            backend=backend,
        )
    finally:
        bar.close()
        total.seconds = time.perf_counter() - start
    return stats, total


def load_conversations(out_dir: str | Path, split: str) -> list[dict]:
    rows: list[dict] = []
    for path in sorted(Path(out_dir).glob(f"{split}-*.jsonl")):
        rows.extend(read_jsonl(path))
    return rows
