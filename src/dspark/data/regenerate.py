"""The target answers each prompt: batched, left-padded sampling, written in resumable shards.

Shard k of a split holds the conversations of prompts [k*N, (k+1)*N) of that split's fixed prompt
list and is written atomically, so after an interruption every shard on disk is complete; a rerun
checks that each finished shard holds exactly its expected ids and skips it. Each shard samples
with its own seed (seed, split, k), so a resumed run writes the same data as an uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .io import DataError, atomic_write_jsonl, read_jsonl, stable_hash
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
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": max(self.top_k, 0)}


def _pad_id(target) -> int:
    tok = target.tokenizer
    return int(tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0])


# Rows whose nucleus fits in this many top tokens skip the full-vocabulary sort (exact either way).
_NUCLEUS_PREFILTER = 512


def nucleus(probs: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p filtering of probabilities [n, V], as transformers' warpers do it (top-p on the
    distribution renormalised over the top-k set; a token is kept while the mass before it < top_p).
    Returns unnormalised kept weights and their token ids, [n, K] each (zero weight = dropped).

    Fast path: take the top 512 first; a row whose nucleus ends inside them is exact already, only the
    other rows pay for a full sort."""
    V = probs.shape[-1]
    k = top_k if 0 < top_k < V else V
    m = min(k, _NUCLEUS_PREFILTER)
    if top_p >= 1.0 and k == V:
        return probs, torch.arange(V, device=probs.device).expand_as(probs)
    vals, idx = probs.topk(m, dim=-1)
    if m < k:  # the prefilter is not the whole top-k set
        covered = vals.sum(-1) >= top_p if k == V else torch.zeros(len(vals), dtype=torch.bool, device=probs.device)
        if not bool(covered.all()):
            full_vals, full_idx = probs.sort(dim=-1, descending=True)
            full_vals, full_idx = full_vals[:, :k], full_idx[:, :k]
            pad = k - m
            vals = torch.cat([vals, vals.new_zeros(len(vals), pad)], -1)
            idx = torch.cat([idx, idx.new_zeros(len(idx), pad)], -1)
            redo = ~covered
            vals[redo], idx[redo] = full_vals[redo], full_idx[redo]
    if top_p < 1.0:
        dist = vals / vals.sum(-1, keepdim=True)  # renormalised over the top-k set
        before = dist.cumsum(-1) - dist
        keep = before < top_p
        keep[:, 0] = True
        vals = vals * keep
    return vals, idx


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of float logits [n, V]: greedy at temperature 0, else temperature, top-k, top-p."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    weights, ids = nucleus(probs, sampling.top_k, sampling.top_p)
    choice = torch.multinomial(weights, 1, generator=generator)
    return ids.gather(-1, choice).squeeze(-1)


@torch.no_grad()
def decode_loop(
    model, ids: torch.Tensor, attn: torch.Tensor, limit: int, sampling: Sampling, eos: Sequence[int],
    generator: torch.Generator | None,
) -> list[Continuation]:
    """Sampling with a KV cache from a left-padded batch; a row that emits a stop token leaves the
    batch at once (its cache rows are dropped), so short answers do not pay for the longest one."""
    from transformers import DynamicCache

    B = ids.shape[0]
    cache = DynamicCache(config=model.config)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    logits = out.logits[:, -1].float()
    next_pos = pos[:, -1] + 1
    rows = torch.arange(B)
    stop = torch.tensor(sorted(set(eos)), device=ids.device)
    tokens: list[list[int]] = [[] for _ in range(B)]
    finished = [False] * B
    for step in range(limit):
        nxt = sample_next(logits, sampling, generator)
        done = torch.isin(nxt, stop)
        for r, t, d in zip(rows.tolist(), nxt.tolist(), done.tolist()):
            if d:
                finished[r] = True
            else:
                tokens[r].append(t)
        if step == limit - 1 or bool(done.all()):
            break
        if bool(done.any()):
            sel = (~done).nonzero().squeeze(1)
            cache.reorder_cache(sel)
            rows, nxt, attn, next_pos = rows[sel.cpu()], nxt[sel], attn[sel], next_pos[sel]
        attn = torch.cat([attn, attn.new_ones(len(nxt), 1)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    return [Continuation(tokens[r], finished[r]) for r in range(B)]


@torch.no_grad()
def generate_continuations(
    target,
    prefixes: Sequence[Sequence[int]],
    sampling: Sampling,
    *,
    batch_size: int,
    seed: object,
    max_new_tokens: Sequence[int] | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    backend: str = "loop",
) -> list[Continuation]:
    """Sample a continuation of every prefix from the target, in left-padded batches.

    backend "loop" is `decode_loop` (finished rows leave the batch: about twice as fast on CPU when
    lengths vary); "hf" is the model's own `generate` (the reference; same distribution). Prefixes
    are batched by length (less padding); batch b samples under seed (seed, b) with its own RNG, so
    results do not depend on anything sampled before. `max_new_tokens` (per prefix) caps a batch at
    its smallest entry. `on_batch(sequences, new_tokens)` reports progress."""
    if backend not in ("loop", "hf"):
        raise DataError(f"generation backend '{backend}' is not 'loop' or 'hf'")
    model, pad, eos = target.model, _pad_id(target), list(target.eos_token_ids)
    order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))
    out: list[Continuation | None] = [None] * len(prefixes)
    device = target.device
    for b, start in enumerate(range(0, len(order), batch_size)):
        idx = order[start : start + batch_size]
        width = max(len(prefixes[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = list(prefixes[i])
            ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[row, width - len(p) :] = 1
        ids, attn = ids.to(device), attn.to(device)
        limit = sampling.max_new_tokens
        if max_new_tokens is not None:
            limit = max(1, min(limit, *(int(max_new_tokens[i]) for i in idx)))
        batch_seed = int(stable_hash([seed, b], 15), 16)
        if backend == "loop":
            gen = torch.Generator(device=device).manual_seed(batch_seed)
            conts = decode_loop(model, ids, attn, limit, sampling, eos, gen)
        else:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(batch_seed)
                seqs = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=limit, eos_token_id=eos,
                                      pad_token_id=pad, **sampling.generate_kwargs())
            conts = []
            for toks in seqs[:, width:].tolist():
                cut = next((k for k, t in enumerate(toks) if t in eos), None)
                conts.append(Continuation(toks[:cut] if cut is not None else toks, cut is not None))
        for i, c in zip(idx, conts):
            out[i] = c
        if on_batch:
            on_batch(len(idx), sum(len(c.tokens) + c.finished for c in conts))
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
        d["conversations_per_min"] = round(60 * self.conversations / self.seconds, 2) if self.seconds else None
        d["answer_tokens_per_s"] = round(self.answer_tokens / self.seconds, 2) if self.seconds else None
        return d


def regenerate_split(
    target,
    prompts: list[dict],
    out_dir: str | Path,
    split: str,
    sampling: Sampling,
    *,
    shard_size: int,
    batch_size: int,
    seed: int,
    max_length: int,
    chat_kwargs: dict | None = None,
    backend: str = "loop",
    write_rows: Callable[[Path, list[dict]], None] = atomic_write_jsonl,
) -> RegenStats:
    """Answer every prompt of one split into `out_dir/<split>-NNNNN.jsonl`; finished shards are
    skipped (after checking they hold exactly the expected prompt ids)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = target.tokenizer
    stats = RegenStats()
    shards = [prompts[i : i + shard_size] for i in range(0, len(prompts), shard_size)]
    todo = []
    for k, shard in enumerate(shards):
        path = shard_path(out_dir, split, k)
        if path.exists():
            have = [r["id"] for r in read_jsonl(path)]
            if have != [p["id"] for p in shard]:
                raise DataError(
                    f"{path} holds other prompts than this run would write there (a different prompt list or "
                    f"shard_size): refusing to mix runs. Delete {out_dir} or use a fresh data.dir."
                )
            stats.skipped_shards += 1
        else:
            todo.append(k)
    if stats.skipped_shards:
        log.info("%s: %d finished shard(s) found, resuming with %d", split, stats.skipped_shards, len(todo))
    start = time.perf_counter()
    bar = tqdm(total=sum(len(shards[k]) for k in todo), desc=f"answering ({split})", unit="conv")
    try:
        for k in todo:
            shard = shards[k]
            prefixes = [prompt_ids(tok, conversation_messages(p), chat_kwargs) for p in shard]
            room = [max(1, max_length - len(p)) for p in prefixes]  # tokens past max_length would be cut anyway

            def progress(n: int, new_tokens: int) -> None:
                stats.answer_tokens += new_tokens
                bar.update(n)
                el = time.perf_counter() - start
                bar.set_postfix(tok_s=f"{stats.answer_tokens / max(el, 1e-9):.0f}")

            conts = generate_continuations(
                target, prefixes, sampling, batch_size=batch_size, seed=[seed, split, k],
                max_new_tokens=room, on_batch=progress, backend=backend,
            )
            rows = []
            for p, c in zip(shard, conts):
                answer = decode(tok, c.tokens)
                rows.append(
                    {
                        "id": p["id"],
                        "split": split,
                        "domain": p.get("domain"),
                        "source": p.get("source"),
                        "messages": conversation_messages(p) + [{"role": "assistant", "content": answer}],
                        "finish": "stop" if c.finished else "length",
                        "answer_tokens": len(c.tokens),
                    }
                )
                stats.finished += c.finished
                stats.cut_at_max_new_tokens += not c.finished
            write_rows(shard_path(out_dir, split, k), rows)
            stats.written_shards += 1
            stats.conversations += len(rows)
    finally:
        bar.close()
        stats.seconds = time.perf_counter() - start
    return stats


def load_conversations(out_dir: str | Path, split: str) -> list[dict]:
    rows: list[dict] = []
    for path in sorted(Path(out_dir).glob(f"{split}-*.jsonl")):
        rows.extend(read_jsonl(path))
    return rows
