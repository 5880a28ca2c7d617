"""Prompt sources (self-generated, local JSONL, Hugging Face hub), filtering and the train/val split.

A prompt record is ``{"id", "prompt", "system" (optional), "domain", "source"}``: one user turn
(plus the system message a `messages` row carried). Only first user turns are kept: the target
answers them, and evaluation likewise drafts for first turns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..core.errors import DataError
from .benchmarks import benchmark_prompt_keys, decontamination_keys
from .io import normalize_text, resolve_path
from .tokenize import prompt_ids, render

log = logging.getLogger(__name__)

SOURCES = ("self_generated", "jsonl", "hub")


@dataclass
class PromptStats:
    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)  # reason -> first few offenders (line numbers / texts)
    generation: dict = field(default_factory=dict)  # self-generation: engine, concurrency, tokens, decode_s

    def drop(self, reason: str, example: object = None) -> None:
        self.counts[reason] += 1
        if example is not None:
            ex = self.examples.setdefault(reason, [])
            if len(ex) < 5:
                ex.append(example)

    def as_dict(self) -> dict:
        out = {"counts": dict(self.counts), "examples": self.examples}
        return out | ({"generation": self.generation} if self.generation else {})


# ----------------------------------------------------------------------------------------------
# Quality filters


def is_degenerate(text: str) -> bool:
    """Degenerate repetition: a long run of one character, a low share of distinct words, one
    trigram covering much of the text, or repeated lines (the failure modes of small samplers)."""
    if re.search(r"(.)\1{29,}", text):
        return True
    words = text.lower().split()
    if len(words) >= 12:
        if len(set(words)) / len(words) < 0.35:
            return True
        trigrams = Counter(zip(words, words[1:], words[2:]))
        if trigrams and trigrams.most_common(1)[0][1] * 3 / len(words) > 0.4:
            return True
    lines = [ln.strip() for ln in text.splitlines() if len(ln.strip()) >= 8]
    return len(lines) >= 4 and len(set(lines)) <= len(lines) // 2


@dataclass
class PromptFilter:
    """Streaming filter: empty, duplicate (whitespace-normalised), benchmark, too short/long in
    characters, degenerate, and too many template tokens (longer than `max_prompt_tokens`)."""

    tokenizer: object
    max_prompt_tokens: int
    min_chars: int = 8
    max_chars: int = 4000
    benchmark_keys: set = field(default_factory=set)
    chat_kwargs: dict = field(default_factory=dict)
    stats: PromptStats = field(default_factory=PromptStats)
    seen: set = field(default_factory=set)

    def accept(self, rec: dict) -> bool:
        text = str(rec.get("prompt") or "").strip()
        if not text:
            self.stats.drop("empty")
            return False
        key = normalize_text(text)
        if key in self.seen:
            self.stats.drop("duplicate")
            return False
        self.seen.add(key)
        if self.benchmark_keys and decontamination_keys(text) & self.benchmark_keys:
            self.stats.drop("benchmark", text[:80])
            return False
        if not self.min_chars <= len(text) <= self.max_chars:
            self.stats.drop("length_chars", len(text))
            return False
        if is_degenerate(text):
            self.stats.drop("repetitive", text[:80])
            return False
        if self.tokenizer is not None:
            n = len(prompt_ids(self.tokenizer, _messages(rec | {"prompt": text}), self.chat_kwargs))
            if n > self.max_prompt_tokens:
                self.stats.drop("too_long_tokens", n)
                return False
        rec["prompt"] = text
        return True


def _messages(rec: dict) -> list[dict]:
    msgs = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
    return msgs + [{"role": "user", "content": rec["prompt"]}]


# ----------------------------------------------------------------------------------------------
# Row formats shared by JSONL and hub rows


def row_to_prompt(row: object, field_name: str | None = None) -> tuple[str, str | None] | None:
    """(first user turn, system message or None) of a row in any supported format, or None."""
    if not isinstance(row, dict):
        return None
    if field_name:
        value = row.get(field_name)
        return (value, None) if isinstance(value, str) else _from_messages(value)
    if isinstance(row.get("turns"), list):
        turns = row["turns"]
        return (turns[0], None) if turns and isinstance(turns[0], str) else None
    for key in ("messages", "conversations", "conversation"):
        if key in row:
            return _from_messages(row[key])
    for key in ("prompt", "instruction", "question", "query"):
        if isinstance(row.get(key), str):
            return row[key], None
    return None


_USER_ROLES = {"user", "human"}


def _from_messages(msgs: object) -> tuple[str, str | None] | None:
    if not isinstance(msgs, list):
        return None
    system = None
    for m in msgs:
        if not isinstance(m, dict):
            return None
        role = str(m.get("role", m.get("from", ""))).lower()
        content = m.get("content", m.get("value"))
        if not isinstance(content, str):
            return None
        if role == "system" and system is None:
            system = content
        elif role in _USER_ROLES:
            return content, system
    return None


# ----------------------------------------------------------------------------------------------
# Sources


def prompt_lines(path: str | Path) -> tuple[Path, list[str]]:
    """The lines of the prompts file data.jsonl.path (DataError when it is missing or not UTF-8)."""
    path = resolve_path(path)
    if not path.is_file():
        raise DataError(f"data.jsonl.path: no such file {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"data.jsonl.path={path} is not UTF-8 text: save it as UTF-8") from None
    return path, text.split("\n")[: -1 if text.endswith("\n") else None]


def read_prompt_jsonl(path: str | Path, strict: bool = False, stats: PromptStats | None = None) -> list[dict]:
    """Prompts of a `{"turns": [...]}` / `{"messages": [...]}` JSONL file. Empty and malformed lines
    are counted (and listed by line number); with `strict` the first one is fatal."""
    path, lines = prompt_lines(path)
    stats = stats if stats is not None else PromptStats()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            reason, parsed = "empty_line", None
        else:
            try:
                row = json.loads(line)
                parsed = row_to_prompt(row)
                reason = None if parsed and parsed[0].strip() else "malformed_line"
            except json.JSONDecodeError:
                reason, parsed = "malformed_line", None
        if reason:
            if strict:
                raise DataError(
                    f"{path}:{n}: {reason.replace('_', ' ')} (expected a JSON object with a non-empty "
                    f"'turns' or "
                    f"'messages' list); set data.strict=false to skip and count such lines"
                )
            stats.drop(reason, n)
            continue
        text, system = parsed
        row_domain = row.get("domain") if isinstance(row, dict) else None
        out.append(
            {
                "id": f"{path.stem}:{n}",
                "prompt": text,
                "system": system,
                "domain": row_domain,
                "source": "jsonl",
            }
        )
    bad = {k: stats.counts[k] for k in ("empty_line", "malformed_line") if stats.counts[k]}
    if bad:
        log.warning("%s: skipped %s (first lines: %s)", path, bad, {k: stats.examples.get(k) for k in bad})
    return out


def load_hub_prompts(cfg_hub) -> list[dict]:
    name = cfg_hub.get("name")
    if not name:
        raise DataError("data.source=hub needs data.hub.name (e.g. mlabonne/open-perfectblend)")
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"data.source=hub ({name}) needs the 'datasets' package: pip install datasets. "
            f"Without the hub, use data=jsonl (a local JSONL file) or data=quick (self-generated prompts)."
        ) from None
    try:
        ds = datasets.load_dataset(name, cfg_hub.get("config"), split=cfg_hub.get("split", "train"))
    except Exception as err:  # offline / not found / auth: many exception types
        raise DataError(
            f"could not load '{name}' from the Hugging Face hub ({err.__class__.__name__}: {err}). "
            f"This machine may "
            f"not reach the hub: use data=jsonl with a local file, or data=quick (self-generated prompts)."
        ) from err
    field_name = cfg_hub.get("field")
    out = []
    for i, row in enumerate(tqdm(ds, desc=f"reading {name}", unit="row", leave=False)):
        parsed = row_to_prompt(row, field_name)
        if parsed:
            out.append(
                {
                    "id": f"{name}:{i}",
                    "prompt": parsed[0],
                    "system": parsed[1],
                    "domain": row.get("category") or row.get("domain"),
                    "source": "hub",
                }
            )
    if not out:
        raise DataError(f"no usable prompts in {name}: set data.hub.field to the column holding the prompt")
    return out


def magpie_prefix(tokenizer, system: str | None, chat_kwargs: dict | None = None) -> list[int]:
    """The template up to where a user message's content begins (Magpie): what the target continues
    with a user prompt of its own."""
    sentinel = "\x00MAGPIE\x00"
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": sentinel}
    ]
    text = render(tokenizer, msgs, add_generation_prompt=False, chat_kwargs=chat_kwargs)
    if sentinel not in text:
        raise DataError(
            "the chat template does not render user content verbatim: cannot self-generate prompts"
        )
    return list(tokenizer(text[: text.index(sentinel)], add_special_tokens=False)["input_ids"])


def salvage_question(text: str) -> str:
    """The text up to its last question mark that ends a sentence: a request the sampler kept
    writing past (SmolLM2 often appends a second paragraph) still opens with a usable question."""
    text = text.strip()
    cut = len(text) - 1 if text.endswith("?") else max(text.rfind("?\n"), text.rfind("? "))
    return text[: cut + 1].strip() if cut >= 0 else ""


class _Enough(Exception):
    """Stops the generation stream once enough prompts were accepted."""


def self_generate_prompts(
    target, cfg_data, prompt_filter: PromptFilter, chat_kwargs: dict | None = None, on_step=None
) -> list[dict]:
    """Magpie-style: the target writes user prompts, topic-steered by an optional system message per
    domain (round-robin by weight), until `num_prompts` pass the filter or `max_candidates_factor` x
    that many candidates were sampled. Candidates are filtered as they complete and generation stops
    as soon as enough passed. A candidate cut at max_new_tokens is kept only up to its last question
    mark (`salvage_unfinished`), else dropped: with SmolLM2 about 40% of candidates run on.
    `prompt_filter.stats.generation` records the engine, its concurrency, the candidate tokens
    and the decoding wall time (decode_s)."""
    from . import generation  # module attribute: tests replace generate_continuations

    sg = cfg_data.self_generated
    n = int(cfg_data.num_prompts)
    topics = [dict(t) for t in sg.topics] or [{"domain": "chat", "system": None}]
    wheel = [i for i, t in enumerate(topics) for _ in range(int(t.get("weight", 1)))]
    prefixes = [magpie_prefix(target.tokenizer, t.get("system"), chat_kwargs) for t in topics]
    sampling = generation.Sampling(
        float(sg.temperature), float(sg.top_p), int(sg.get("top_k", 0) or 0), int(sg.max_new_tokens)
    )
    max_candidates = int(math.ceil(n * float(sg.max_candidates_factor)))
    salvage = bool(sg.get("salvage_unfinished", True))
    engine = generation.engine_options(cfg_data)
    gen_stats = prompt_filter.stats.generation
    gen_stats.update(tokens=0, decode_s=0.0)
    accepted: list[dict] = []
    drawn, rnd = 0, 0
    bar = tqdm(total=n, desc="self-generating prompts", unit="prompt")
    try:
        while len(accepted) < n and drawn < max_candidates:
            # Over-draw (a share is filtered out); the stream stops early once enough passed.
            m = min(max_candidates - drawn, max(int(sg.batch_size), 2 * (n - len(accepted))))
            chosen = [wheel[(drawn + j) % len(wheel)] for j in range(m)]
            base = drawn

            def on_result(j: int, c, chosen=chosen, base=base) -> None:
                prompt_filter.stats.counts["candidates_done"] += 1
                gen_stats["tokens"] += len(c.tokens) + c.finished
                bar.set_postfix(candidates=prompt_filter.stats.counts["candidates_done"])
                text = generation.decode(target.tokenizer, c.tokens)
                if not c.finished:  # cut at max_new_tokens: keep its leading complete question, if any
                    text = salvage_question(text) if salvage else ""
                    prompt_filter.stats.counts["salvaged" if text else "unfinished"] += 1
                    if not text:
                        return
                rec = {
                    "id": f"sg-{base + j:06d}",
                    "prompt": text,
                    "system": None,
                    "domain": topics[chosen[j]].get("domain"),
                    "source": "self_generated",
                }
                if prompt_filter.accept(rec):
                    accepted.append(rec)
                    bar.update(1)
                    if len(accepted) >= n:
                        raise _Enough

            report: dict = {}
            with contextlib.suppress(_Enough):
                generation.generate_continuations(
                    target,
                    [prefixes[t] for t in chosen],
                    sampling,
                    batch_size=int(sg.batch_size),
                    seed=[cfg_data.seed, "prompts", rnd],
                    on_result=on_result,
                    on_step=on_step,
                    report=report,
                    **engine,
                )
            gen_stats.update(
                {k: report.get(k) for k in ("engine", "compile", "concurrency")},
                decode_s=gen_stats["decode_s"] + report.get("seconds", 0.0),
            )
            drawn += m
            rnd += 1
    finally:
        bar.close()
    prompt_filter.stats.counts["candidates_drawn"] = drawn
    if len(accepted) < n:
        log.warning(
            "self-generation: only %d of %d prompts passed the filters after %d candidates (%s)",
            len(accepted),
            n,
            drawn,
            dict(prompt_filter.stats.counts),
        )
    return sorted(accepted, key=lambda r: r["id"])


def _seeded_shuffle(records: list[dict], seed: int) -> list[dict]:
    out = list(records)
    random.Random(seed).shuffle(out)
    return out


def take_filtered(records: Iterable[dict], prompt_filter: PromptFilter, n: int) -> list[dict]:
    out: list[dict] = []
    it: Iterator[dict] = iter(records)
    for rec in it:
        if prompt_filter.accept(rec):
            out.append(rec)
            if len(out) >= n:
                break
    return out


def split_train_val(records: list[dict], val_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Deterministic split: a seeded permutation picks round(n * val_fraction) validation prompts (at
    least one when val_fraction > 0 and n >= 2); both splits keep the input order."""
    n = len(records)
    n_val = round(n * float(val_fraction))
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    val_idx = set(random.Random(f"split:{seed}").sample(range(n), n_val)) if n_val else set()
    train = [r for i, r in enumerate(records) if i not in val_idx]
    val = [r for i, r in enumerate(records) if i in val_idx]
    return train, val


def max_prompt_tokens(cfg_data) -> int:
    limit = cfg_data.get("max_prompt_length") or int(cfg_data.max_length) // 2
    return min(int(limit), int(cfg_data.max_length) - 1)


def build_prompts(
    cfg_data, tokenizer, target=None, chat_kwargs: dict | None = None, on_step=None
) -> tuple[list[dict], list[dict], PromptStats]:
    """Prompts of the configured source, filtered, decontaminated, capped at num_prompts and split."""
    source = cfg_data.get("source", "self_generated")
    if source not in SOURCES:
        raise DataError(f"data.source '{source}' is not one of {SOURCES}")
    keys: set[str] = set()
    if cfg_data.get("benchmark_dir"):
        keys = benchmark_prompt_keys(cfg_data.benchmark_dir)
    else:
        log.warning("data.benchmark_dir is null: training prompts are NOT checked against the benchmarks")
    flt = PromptFilter(
        tokenizer=tokenizer,
        max_prompt_tokens=max_prompt_tokens(cfg_data),
        min_chars=int(cfg_data.get("min_prompt_chars", 8)),
        max_chars=int(cfg_data.get("max_prompt_chars", 4000)),
        benchmark_keys=keys,
        chat_kwargs=dict(chat_kwargs or {}),
    )
    n = int(cfg_data.num_prompts)
    seed = int(cfg_data.seed)
    if source == "self_generated":
        if target is None:
            raise DataError("data.source=self_generated needs the target model")
        records = self_generate_prompts(target, cfg_data, flt, chat_kwargs, on_step=on_step)
    elif source == "jsonl":
        path = (cfg_data.get("jsonl") or {}).get("path")
        if not path:
            raise DataError("data.source=jsonl needs data.jsonl.path")
        rows = read_prompt_jsonl(path, strict=bool(cfg_data.get("strict", False)), stats=flt.stats)
        records = take_filtered(_seeded_shuffle(rows, seed), flt, n)
    else:
        rows = load_hub_prompts(cfg_data.hub)
        records = take_filtered(_seeded_shuffle(rows, seed), flt, n)
    if not records:
        raise DataError(f"no prompt survived the filters ({dict(flt.stats.counts)})")
    if len(records) < n:
        log.warning("only %d prompts available after filtering (data.num_prompts=%d)", len(records), n)
    train, val = split_train_val(records, float(cfg_data.get("val_fraction", 0.1)), seed)
    log.info("prompts: %d train / %d val; dropped %s", len(train), len(val), dict(flt.stats.counts))
    return train, val, flt.stats
