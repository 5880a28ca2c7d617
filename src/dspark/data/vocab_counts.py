"""The draft vocabulary an engine serves a drafter with (``decoding.draft_vocab``), from the token
counts its folder carries or from the data it was trained on."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..artifacts import DrafterFolder
from ..core.errors import ConfigError
from ..decoding.draft_vocab import answer_token_counts, coverage, draft_vocab_from_counts
from .datamodule import tokens_path
from .tokenize import load_tokens

__all__ = ["load_draft_vocab", "served_vocab_size", "vocab_record"]


def served_vocab_size(requested, drafter_dir) -> int:
    """The draft vocabulary's size an engine serves the drafter of ``drafter_dir`` with: ``requested``
    (0: the whole vocabulary), or for None the drafter's own, the K its loss covered in training
    (``draft_vocab`` in its config; the whole vocabulary when it has none)."""
    if requested is not None:
        return int(requested)
    return int(DrafterFolder(str(drafter_dir)).read_config().get("draft_vocab") or 0)


def load_draft_vocab(drafter_dir, size: int, vocab_size: int, always: Iterable[int] = (), counts_from=None):
    """(vocabulary or None, its coverage of the counted tokens) for an engine serving the drafter
    of ``drafter_dir``: the ``size`` most frequent tokens of its training answers, counted in
    ``counts_from`` (a data folder holding tokens/train.safetensors, or a counts file) or else in
    the drafter folder's own token_counts.safetensors. Errors name the fix, before any decoding."""
    if int(size) == 0:
        return None, 1.0
    if counts_from is not None:
        source = Path(counts_from).expanduser()
        if source.is_dir():
            counts = answer_token_counts([load_tokens(tokens_path(source, "train"))], vocab_size)
        else:
            counts = DrafterFolder.load_token_counts(source)
    else:
        counts = DrafterFolder(drafter_dir).read_token_counts()
        if counts is None:
            raise ConfigError(
                f"draft_vocab={size} needs token counts, and {drafter_dir} has no "
                f"{DrafterFolder.TOKEN_COUNTS} (trained before training wrote them): pass "
                f"draft_vocab_counts=<the data folder it was trained on>"
            )
    if counts.numel() != vocab_size:
        raise ConfigError(
            f"the token counts cover {counts.numel()} ids, the target's vocabulary {vocab_size}: "
            f"counts of another target's data"
        )
    vocab = draft_vocab_from_counts(counts, size, always)
    return vocab, (1.0 if vocab is None else coverage(counts, vocab))


def vocab_record(vocab, coverage: float) -> dict | None:
    """What a report records of a served draft vocabulary: its size and coverage (None: the whole)."""
    return None if vocab is None else {"size": int(vocab.numel()), "coverage": round(coverage, 6)}
