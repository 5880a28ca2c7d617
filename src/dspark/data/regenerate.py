"""The target answers each prompt (engine decoding, ``generation``), written in resumable shards.

Shard k of a split holds the conversations of prompts [k*N, (k+1)*N) of that split's fixed prompt
list and is written atomically, so after an interruption every shard on disk is complete; a rerun
checks that each finished shard holds exactly its expected ids, skips it, and answers only the
prompts of the other shards: no sample is lost or written twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..core.errors import DataError
from ..core.io import atomic_write_jsonl, read_jsonl
from .generation import Continuation, Sampling, decode, generate_continuations
from .tokenize import prompt_ids

log = logging.getLogger(__name__)

__all__ = ["Continuation", "RegenStats", "Sampling", "load_conversations", "regenerate"]


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
    engine: str | None = None  # plain | fast (None: nothing was generated)
    concurrency: int | None = None
    rounds: dict | None = None  # generation.round_times of the decode rounds (None: cut short)

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
    engine: str = "auto",
    compile: bool = False,
    write_rows: Callable[[Path, list[dict]], None] = atomic_write_jsonl,
    on_step: Callable[[], None] | None = None,
) -> tuple[dict[str, RegenStats], RegenStats]:
    """Answer every prompt of every split into `out_dir/<split>-NNNNN.jsonl`.

    Finished shards are skipped (after checking they hold exactly the expected prompt ids); the
    prompts of all other shards, of all splits, stream through one generation pass (one batch
    tail instead of one per split), and each shard is written the moment its last answer arrives.
    Returns per-split counts and the totals (with the wall time, engine and concurrency of the
    pass)."""
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

    report: dict = {}
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
            engine=engine,
            compile=compile,
            report=report,
        )
    finally:
        bar.close()
        total.seconds = time.perf_counter() - start
        total.engine, total.concurrency = report.get("engine"), report.get("concurrency")
        total.rounds = report.get("rounds")
    return stats, total


def load_conversations(out_dir: str | Path, split: str) -> list[dict]:
    rows: list[dict] = []
    for path in sorted(Path(out_dir).glob(f"{split}-*.jsonl")):
        rows.extend(read_jsonl(path))
    return rows
