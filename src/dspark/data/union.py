"""Training on several prepared folders at once (``data.extra_dirs``): their training splits join
data.dir's, so sets made in separate sessions (another ``data.seed``) add up instead of one set
being rebuilt larger. A joined conversation whose prompt data.dir (either split) or an earlier
folder already holds is left out: a prompt drawn twice must not weigh twice, and one of data.dir's
validation prompts must not be trained on."""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import torch

from .tokenize import TokenSplit

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
