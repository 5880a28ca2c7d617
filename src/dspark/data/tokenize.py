"""Chat-template tokenisation with an assistant-only loss mask.

The mask comes from character spans, not from template-specific token patterns: render the
conversation to text with the target's own template, find each assistant message's content in
that text, and map the spans to tokens through the tokenizer's offsets. A span also covers the
end-of-turn marker right after the content (``<|im_end|>``, ``<end_of_turn>``): the target emitted
it to stop, so the drafter must learn to predict it too. Template text (role headers, Qwen3's empty
``<think>`` block in non-thinking mode) stays unmasked.

Truncation policy: a conversation longer than ``max_length`` tokens keeps its first ``max_length``
tokens (right truncation; the prompt stage already dropped prompts longer than
``max_prompt_length``, so some of the answer always survives). A sample with no assistant token
left is dropped and counted. An answer that hit ``max_new_tokens`` (``finish == "length"``) is cut
right after its last content token: the closing marker the template would add was never generated.

`tokenize_records` spreads a large set over forked worker processes (`data.tokenize_workers`): each
tokenises a contiguous chunk and the chunks are joined in order, so the result equals the serial one.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..core.errors import DataError
from ..core.io import atomic_save_safetensors

log = logging.getLogger(__name__)

MAX_WORKERS = 16  # "auto" stops here: every fork copies the parent's page tables; it alone joins results
MIN_PARALLEL = 2000  # fewer records stay serial: forking a pool costs more than it saves
CHUNKS_PER_WORKER = 8  # finer chunks balance the load and move the progress bar more often


class TemplateError(DataError):
    """A chat template the loss mask cannot be derived from."""


def render(
    tokenizer, messages: list[dict], *, add_generation_prompt: bool, chat_kwargs: dict | None = None
) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_kwargs or {})
    )


def encode_text(tokenizer, text: str) -> list[int]:
    # The rendered template already holds its special tokens (bos included where the template wants it).
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer, messages: list[dict], chat_kwargs: dict | None = None) -> list[int]:
    """Token ids the target sees before it writes the next assistant turn."""
    return encode_text(
        tokenizer, render(tokenizer, messages, add_generation_prompt=True, chat_kwargs=chat_kwargs)
    )


def end_markers(tokenizer, eos_token_ids: Sequence[int]) -> list[str]:
    """Strings of the target's stop tokens, longest first (so a marker is never cut short)."""
    names = tokenizer.convert_ids_to_tokens(list(eos_token_ids))
    return sorted({n for n in names if n}, key=len, reverse=True)


def _locate(text: str, content: str, start: int) -> tuple[int, int] | None:
    needle = content.strip()
    pos = text.find(needle, start)
    if pos >= 0:
        return pos, pos + len(needle)
    # Reasoning templates (Qwen3) re-render or drop a <think> block; the answer after it is still verbatim.
    if "</think>" in needle:
        answer = needle.rsplit("</think>", 1)[1].strip()
        pos = text.find(answer, start) if answer else -1
        if pos >= 0:
            return pos, pos + len(answer)
    return None


def assistant_spans(text: str, messages: list[dict], markers: Sequence[str] = ()) -> list[tuple[int, int]]:
    """Character spans [start, end) of each non-empty assistant message in the rendered `text`.

    Messages are located in order, so an answer that repeats the question matches after the question.
    Raises TemplateError when an assistant message is not rendered verbatim."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, str):
            raise TemplateError(
                f"message {i} ({msg.get('role')}) has non-text content; only text chats are supported"
            )
        if not content.strip():
            continue
        found = _locate(text, content, cursor)
        if msg.get("role") != "assistant":
            if found:  # a template may rewrite system text (Gemma folds it into the user turn): not fatal
                cursor = found[1]
            continue
        if found is None:
            raise TemplateError(
                f"the chat template does not render assistant message {i} verbatim, so no loss mask can "
                f"be derived from it (rendered text starts {text[:160]!r}). Use a template that emits "
                f"assistant content as "
                f"is (set target.chat_template), e.g. ChatML."
            )
        start, end = found
        for marker in markers:
            if text.startswith(marker, end):
                end += len(marker)
                break
        spans.append((start, end))
        cursor = end
    if not spans and any(
        m.get("role") == "assistant" and str(m.get("content", "")).strip() for m in messages
    ):
        raise TemplateError("the chat template rendered no assistant span")
    return spans


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[bool]
    truncated: bool = False


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    *,
    max_length: int,
    chat_kwargs: dict | None = None,
    markers: Sequence[str] = (),
    complete: bool = True,
) -> Tokenized | None:
    """input_ids and assistant-only loss mask of one conversation; None when no assistant token fits."""
    text = render(tokenizer, messages, add_generation_prompt=False, chat_kwargs=chat_kwargs)
    spans = assistant_spans(text, messages, markers if complete else ())
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [any(s < e_span and e > s_span for s_span, e_span in spans) and e > s for s, e in offsets]
    if not complete and any(mask):
        last = max(i for i, m in enumerate(mask) if m)
        ids, mask = ids[: last + 1], mask[: last + 1]
    truncated = len(ids) > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return None
    return Tokenized(ids, mask, truncated)


@dataclass
class TokenStats:
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    dropped_no_assistant_tokens: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra

    def add(self, other: TokenStats) -> None:
        for f in fields(self):
            if f.name != "extra":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


Chunk = tuple[list[str], list[Tokenized], TokenStats]


def tokenize_workers(setting: int | str | None = "auto") -> int:
    """Processes for `tokenize_records`: "auto" (or None) is the cores this process may run on, at
    most MAX_WORKERS; a number is taken as is (at least 1)."""
    if setting in (None, "auto"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, min(cores or 1, MAX_WORKERS))
    return max(1, int(setting))


def tokenize_records(
    tokenizer,
    records: list[dict],
    *,
    max_length: int,
    chat_kwargs: dict | None = None,
    markers: Sequence[str] = (),
    desc: str = "tokenising",
    workers: int | str | None = "auto",
    min_parallel: int = MIN_PARALLEL,
) -> tuple[list[str], list[Tokenized], TokenStats]:
    """Tokenise regenerated conversations ({"id", "messages", "finish"}): serially with one worker or
    fewer than `min_parallel` records, else in `workers` forked processes (same result, same order)."""
    options = {"max_length": max_length, "chat_kwargs": chat_kwargs, "markers": tuple(markers)}
    workers = tokenize_workers(workers)
    if workers > 1 and len(records) >= max(min_parallel, 1):
        if "fork" not in multiprocessing.get_all_start_methods():  # spawning would pickle the tokenizer
            log.warning("this platform cannot fork: tokenising %d records serially", len(records))
        else:
            try:
                return _tokenize_parallel(tokenizer, records, options, workers, desc)
            except (OSError, BrokenProcessPool) as err:  # the pool could not start, or a worker died
                log.warning("parallel tokenisation failed (%r): tokenising serially", err)
    return _tokenize_chunk(tokenizer, tqdm(records, desc=desc, unit="conv", leave=False), options)


def _tokenize_chunk(tokenizer, records: Iterable[dict], options: dict) -> Chunk:
    ids, out, stats = [], [], TokenStats()
    for rec in records:
        tok = tokenize_conversation(
            tokenizer, rec["messages"], complete=rec.get("finish", "stop") == "stop", **options
        )
        if tok is None:
            stats.dropped_no_assistant_tokens += 1
            continue
        ids.append(rec["id"])
        out.append(tok)
        stats.samples += 1
        stats.tokens += len(tok.input_ids)
        stats.loss_tokens += sum(tok.loss_mask)
        stats.truncated += tok.truncated
    return ids, out, stats


# What a worker process tokenises: set by the pool's initializer, which a forked child runs on the
# parent's objects as they are (the tokenizer and the records are inherited, never pickled).
_JOB: tuple | None = None


def _init_worker(tokenizer, records: list[dict], options: dict) -> None:
    global _JOB
    _JOB = (tokenizer, records, options)


def _run_span(span: tuple[int, int]) -> Chunk:
    tokenizer, records, options = _JOB
    return _tokenize_chunk(tokenizer, records[span[0] : span[1]], options)


def _tokenize_parallel(tokenizer, records: list[dict], options: dict, workers: int, desc: str) -> Chunk:
    n = len(records)
    step = -(-n // (workers * CHUNKS_PER_WORKER))
    spans = [(a, min(a + step, n)) for a in range(0, n, step)]
    ids, out, stats = [], [], TokenStats()
    with (
        _tokenizer_threads_off(),
        ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_init_worker,
            initargs=(tokenizer, records, options),
        ) as pool,
        tqdm(total=n, desc=f"{desc} ({workers} processes)", unit="conv", leave=False) as bar,
    ):
        for (a, b), (i, o, s) in zip(spans, pool.map(_run_span, spans)):  # map keeps the spans' order
            ids += i
            out += o
            stats.add(s)
            bar.update(b - a)
    return ids, out, stats


@contextmanager
def _tokenizer_threads_off():
    """TOKENIZERS_PARALLELISM=false while the pool forks: the Rust tokenizer's thread pool does not
    survive a fork (it warns, or deadlocks), and each child is one worker anyway."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def save_tokens(path: str | Path, sample_ids: list[str], samples: list[Tokenized], meta: dict) -> None:
    """One split as three flat tensors (ragged by `offsets`), written atomically."""
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    flat_ids = [t for s in samples for t in s.input_ids]
    flat_mask = [m for s in samples for m in s.loss_mask]
    tensors = {
        "input_ids": torch.tensor(flat_ids, dtype=torch.int32),
        "loss_mask": torch.tensor(flat_mask, dtype=torch.uint8),
        "offsets": offsets,
    }
    metadata = {"ids": json.dumps(sample_ids), "meta": json.dumps(meta)}
    atomic_save_safetensors(path, tensors, metadata)


@dataclass
class TokenSplit:
    """A loaded split: sample i is input_ids[offsets[i]:offsets[i+1]]."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    offsets: torch.Tensor
    ids: list[str]
    meta: dict

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b].long(), self.loss_mask[a:b].bool()


def load_tokens(path: str | Path) -> TokenSplit:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise DataError(f"tokenised split {path} is missing: run python -m dspark.prepare for this data.dir")
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        md = f.metadata() or {}
    return TokenSplit(
        tensors["input_ids"],
        tensors["loss_mask"],
        tensors["offsets"],
        json.loads(md["ids"]),
        json.loads(md["meta"]),
    )
