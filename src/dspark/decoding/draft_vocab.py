"""Draft vocabularies (FR-Spec's frequency-ranked vocabulary, EAGLE-3's d2t): the K target tokens a
drafter may draft, the K most frequent in the answers it was trained on.

The draft step's LM head and softmax then cover K columns instead of V (``core.types.Shared``), which
is most of the draft step where the vocabulary is large (Gemma-3's 262 144 tokens) or the batch is
(R = 256 on SmolLM2). Speculation stays lossless: a token outside the vocabulary has draft
probability 0, so the target's residual keeps all of its mass; the cost is only the acceptance of
the tokens the drafter can no longer propose, which ``coverage`` estimates.

Training writes the counts into the drafter folder (``token_counts.safetensors``, the answers'
tokens of its training split); ``data.vocab_counts`` reads them back, or counts an older folder's
training data, and picks the vocabulary an engine serves."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ..core.errors import ConfigError, DataError

__all__ = [
    "answer_token_counts",
    "check_draft_vocab",
    "coverage",
    "draft_vocab_from_counts",
    "most_frequent",
]


def answer_token_counts(splits: Iterable, vocab_size: int) -> Tensor:
    """How often each token id occurs in the trained-on (loss-masked) positions of tokenised splits
    (``data.tokenize.TokenSplit``): [V] int64."""
    counts = torch.zeros(int(vocab_size), dtype=torch.long)
    for split in splits:
        ids = split.input_ids[split.loss_mask.bool()].long()
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
            raise DataError(
                f"token ids {int(ids.min())}..{int(ids.max())} fall outside the target's vocabulary of "
                f"{vocab_size}: the data was tokenised for another target"
            )
        counts += torch.bincount(ids, minlength=int(vocab_size))
    return counts


def most_frequent(counts: Tensor, size: int, always: Iterable[int] = ()) -> Tensor:
    """The ``size`` most frequent token ids of ``counts`` [V] (ties: the lower id), with every id of
    ``always`` (the end-of-sequence tokens: a drafter that cannot draft them cannot end an answer)
    included, sorted ascending: [size] int64."""
    v = counts.numel()
    if not 0 < size < v:
        raise ConfigError(f"draft_vocab={size}: a draft vocabulary has 1..{v - 1} tokens (0: the whole {v})")
    forced = sorted({int(t) for t in always})
    if any(not 0 <= t < v for t in forced) or len(forced) > size:
        raise ConfigError(
            f"draft_vocab={size} cannot hold the tokens {forced} it must (of a vocabulary of {v})"
        )
    score = counts.double().clone()
    score[forced] = float("inf")
    order = torch.argsort(-score, stable=True)  # stable: equal counts keep the lower id first
    return order[:size].sort().values


def check_draft_vocab(vocab: Tensor, vocab_size: int) -> Tensor:
    """``vocab`` as the engines take it ([K] int64, strictly increasing ids in [0, V), 0 < K ≤ V),
    or a ValueError naming what is wrong."""
    if vocab.dim() != 1 or vocab.numel() == 0 or vocab.dtype.is_floating_point or vocab.dtype == torch.bool:
        raise ValueError(
            f"a draft vocabulary is a non-empty 1-D tensor of token ids, "
            f"got {vocab.dtype} {tuple(vocab.shape)}"
        )
    vocab = vocab.long()
    if int(vocab.min()) < 0 or int(vocab.max()) >= vocab_size:
        raise ValueError(
            f"draft vocabulary ids {int(vocab.min())}..{int(vocab.max())} outside [0, {vocab_size})"
        )
    if vocab.numel() > 1 and not bool((vocab[1:] > vocab[:-1]).all()):
        raise ValueError("draft vocabulary ids must be unique and sorted ascending (torch.unique gives both)")
    return vocab


def coverage(counts: Tensor, vocab: Tensor) -> float:
    """The share of the counted tokens that the vocabulary holds (1.0 without counts)."""
    total = int(counts.sum())
    return float(counts[vocab.to(counts.device)].sum()) / total if total else 1.0


def draft_vocab_from_counts(counts: Tensor, size: int, always: Iterable[int] = ()) -> Tensor | None:
    """``most_frequent``, or None (the whole vocabulary) for ``size`` 0 or at least the vocabulary's."""
    size = int(size)
    if size < 0:
        raise ConfigError(
            f"draft_vocab={size} is negative: give a token count, or 0 for the whole vocabulary"
        )
    if size == 0 or size >= counts.numel():
        return None
    return most_frequent(counts, size, always)
