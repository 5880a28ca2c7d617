"""Training on several prepared folders at once (``data.extra_dirs``): their training splits join
data.dir's, so sets made in separate sessions (another ``data.seed``) add up instead of one set
being rebuilt larger. A joined conversation whose prompt data.dir (either split) or an earlier
folder already holds is left out: a prompt drawn twice must not weigh twice, and one of data.dir's
validation prompts must not be trained on.

    python -m dspark.data.union DATA_DIR EXTRA_DIR … [--json OUT]   # what a run would train on
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from ..core.io import atomic_write_json
from .tokenize import TokenSplit, load_tokens

log = logging.getLogger(__name__)


def prompt_keys(split: TokenSplit) -> list[bytes]:
    """A digest per conversation of its tokens before its first trained token: the templated
    system and user turns, what the answer was generated from."""
    ids = split.input_ids.numpy()
    offsets = split.offsets.numpy()
    starts, ends = offsets[:-1], offsets[1:]
    trained = np.flatnonzero(split.loss_mask.numpy())
    # Each conversation's first trained position: the first one at or after its start, unless that
    # lies past its end (none trained: the whole conversation is the key).
    at = np.searchsorted(trained, starts)
    first = (
        np.where(at < len(trained), trained[np.minimum(at, len(trained) - 1)], ends) if len(trained) else ends
    )
    first = np.minimum(first, ends)
    return [hashlib.blake2b(ids[a:b].tobytes(), digest_size=16).digest() for a, b in zip(starts, first)]


def _select(split: TokenSplit, keep: np.ndarray, prefix: str) -> TokenSplit:
    lengths = (split.offsets[1:] - split.offsets[:-1]).numpy()
    flat = torch.from_numpy(np.repeat(keep, lengths))
    offsets = torch.zeros(int(keep.sum()) + 1, dtype=split.offsets.dtype)
    offsets[1:] = torch.from_numpy(lengths[keep]).cumsum(0)
    ids = [f"{prefix}{i}" for i, k in zip(split.ids, keep) if k]
    return TokenSplit(split.input_ids[flat], split.loss_mask[flat], offsets, ids, split.meta)


def join_splits(
    train: TokenSplit, extras: dict[str, TokenSplit], held_out: TokenSplit | None = None
) -> TokenSplit:
    """``train`` followed by each of ``extras`` ({name: training split}) but its conversations whose
    prompt ``train``, ``held_out`` (data.dir's validation split) or an earlier extra holds. The joined
    ids are ``<name>:<id>`` for the extras'; the meta is ``train``'s."""
    seen = set(prompt_keys(train))
    if held_out is not None:
        seen |= set(prompt_keys(held_out))
    parts = [train]
    for name, split in extras.items():
        keep = np.zeros(len(split), dtype=bool)
        for i, key in enumerate(prompt_keys(split)):
            keep[i] = key not in seen
            seen.add(key)
        log.info("data.extra_dirs %s: %d of %d conversations joined (%d prompts already held)",
                 name, int(keep.sum()), len(split), int((~keep).sum()))  # fmt: skip
        parts.append(_select(split, keep, f"{name}:"))
    if len(parts) == 1:
        return train
    sizes = [p.input_ids.numel() for p in parts]
    offsets = [parts[0].offsets] + [p.offsets[1:] + base for p, base in zip(parts[1:], np.cumsum(sizes)[:-1])]
    return TokenSplit(
        torch.cat([p.input_ids for p in parts]),
        torch.cat([p.loss_mask for p in parts]),
        torch.cat(offsets),
        [i for p in parts for i in p.ids],
        train.meta,
    )


def describe(data_dir: str | Path, extra_dirs: list[str | Path]) -> dict:
    """The training split a run on ``data_dir`` with ``data.extra_dirs=extra_dirs`` draws from: each
    folder's conversations and how many of them join, the joined totals (tokens, trained tokens)."""
    from .datamodule import tokens_path  # the data module joins with this module's join_splits

    def tokens(folder, split):
        return load_tokens(tokens_path(folder, split))

    train, extras = tokens(data_dir, "train"), {str(d): tokens(d, "train") for d in extra_dirs}
    joined = join_splits(train, extras, held_out=tokens(data_dir, "val"))
    added = joined.ids[len(train) :]
    folders = {str(data_dir): {"conversations": len(train), "joined": len(train)}}
    for name, split in extras.items():
        folders[name] = {"conversations": len(split), "joined": sum(i.startswith(f"{name}:") for i in added)}
    return {
        "folders": folders,
        "train_conversations": len(joined),
        "tokens": int(joined.input_ids.numel()),
        "trained_tokens": int(joined.loss_mask.sum()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspark.data.union", description=describe.__doc__)
    parser.add_argument("data_dir")
    parser.add_argument("extra_dirs", nargs="+")
    parser.add_argument("--json", help="also write the description here")
    args = parser.parse_args(argv)
    out = describe(args.data_dir, args.extra_dirs)
    print(json.dumps(out, indent=1))
    if args.json:
        atomic_write_json(args.json, out)


if __name__ == "__main__":
    main(sys.argv[1:])
