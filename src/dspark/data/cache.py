"""Optional offline target cache: per sample the tap features [T, m*d] and the last hidden state
[T, d] in bf16, so training never runs the target (its logits are recomputed from last_hidden at
the sampled positions through the frozen LM head; full-vocabulary logits are never stored).

Layout: ``<dir>/cache/<split>-NNNNN.safetensors`` (keys ``taps.<i>`` / ``last_hidden.<i>`` for
sample i of the split) and ``manifest.json`` with the target fingerprint (model, dtype, tap ids,
sizes) and a digest of the tokenised split each shard was computed from. Shards are written
atomically and skipped on a rerun, so an interrupted build resumes.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..core.errors import DataError
from ..core.io import atomic_save_safetensors, atomic_write_json, read_json
from .tokenize import TokenSplit

log = logging.getLogger(__name__)

CACHE_DTYPE = torch.bfloat16
MANIFEST = "manifest.json"


class CacheMismatch(DataError):
    """A cache built for another target (or other tokens) than the one in use."""


def target_fingerprint(target) -> dict:
    """What the cached features depend on. `Target.fingerprint` names model source and dtype; the tap
    layout and sizes are added so a different tap choice is also refused."""
    return {
        "fingerprint": target.fingerprint,
        "name": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "layer_ids": list(target.layer_ids),
        "hidden_size": int(target.hidden_size),
        "num_layers": int(target.num_layers),
    }


def tokens_digest(split: TokenSplit) -> str:
    h = hashlib.sha256()
    for t in (split.input_ids, split.offsets):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def bytes_per_token(fp: dict) -> int:
    return (len(fp["layer_ids"]) + 1) * int(fp["hidden_size"]) * torch.finfo(CACHE_DTYPE).bits // 8


def estimate_bytes(num_tokens: int, fp: dict) -> int:
    return int(num_tokens) * bytes_per_token(fp)


def check_manifest(manifest: dict, expected: dict, where: Path) -> None:
    got = manifest.get("target", {})
    diff = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
    if diff:
        detail = "; ".join(f"{k}: cache has {a!r}, target has {b!r}" for k, (a, b) in diff.items())
        raise CacheMismatch(
            f"the offline cache at {where} was built for another target ({detail}). Rebuild it for "
            f"this target (delete {where} and run python -m dspark.prepare data.offline_cache=true "
            f"with this target), or use "
            f"features=online."
        )


def shard_file(split: str, k: int) -> str:
    return f"{split}-{k:05d}.safetensors"


@torch.no_grad()
def build_cache(
    target,
    splits: dict[str, TokenSplit],
    cache_dir: str | Path,
    *,
    batch_size: int = 8,
    shard_size: int = 64,
    max_gb: float = 20.0,
) -> dict:
    """Compute and store target features for every sample of every split; returns the manifest."""
    cache_dir = Path(cache_dir)
    fp = target_fingerprint(target)
    total_tokens = sum(int(s.offsets[-1]) for s in splits.values())
    est = estimate_bytes(total_tokens, fp)
    msg = (
        f"offline cache: {total_tokens} tokens x {bytes_per_token(fp)} B/token "
        f"({len(fp['layer_ids'])} taps + last hidden, d={fp['hidden_size']}, bf16) ~ {est / 1e9:.2f} GB"
    )
    print(msg, flush=True)
    log.info(msg)
    if est > float(max_gb) * 1e9:
        raise DataError(
            f"{msg}: more than data.cache_max_gb={max_gb}. Raise data.cache_max_gb, use fewer prompts "
            f"or a shorter "
            f"max_length, or train with features=online."
        )
    manifest_path = cache_dir / MANIFEST
    digests = {name: tokens_digest(s) for name, s in splits.items()}
    if manifest_path.exists():
        old = read_json(manifest_path)
        check_manifest(old, fp, cache_dir)
        stale = [
            n for n in splits if old.get("splits", {}).get(n, {}).get("tokens") not in (None, digests[n])
        ]
        if stale:
            raise CacheMismatch(
                f"the cache at {cache_dir} was built from other tokens for {stale}; delete it to rebuild"
            )
    manifest = {
        "version": 1,
        "complete": False,
        "target": fp,
        "dtype": "bfloat16",
        "splits": {
            n: {
                "num_samples": len(s),
                "tokens": digests[n],
                "shard_size": shard_size,
                "shards": [shard_file(n, k) for k in range(-(-len(s) // shard_size))],
            }
            for n, s in splits.items()
        },
        "estimated_bytes": est,
    }
    atomic_write_json(manifest_path, manifest)  # written first so a resumed build is checked against it
    device, pad = target.device, int(target.tokenizer.pad_token_id or 0)
    bar = tqdm(total=total_tokens, desc="caching target features", unit="tok", unit_scale=True)
    try:
        for name, split in splits.items():
            for k, fname in enumerate(manifest["splits"][name]["shards"]):
                lo, hi = k * shard_size, min(len(split), (k + 1) * shard_size)
                n_tok = int(split.offsets[hi] - split.offsets[lo])
                if (cache_dir / fname).exists():
                    bar.update(n_tok)
                    continue
                tensors: dict[str, torch.Tensor] = {}
                order = sorted(range(lo, hi), key=lambda i: int(split.lengths[i]))  # less padding per batch
                for b in range(0, len(order), batch_size):
                    idx = order[b : b + batch_size]
                    seqs = [split.sample(i)[0] for i in idx]
                    width = max(len(s) for s in seqs)
                    ids = torch.full((len(idx), width), pad, dtype=torch.long)
                    attn = torch.zeros((len(idx), width), dtype=torch.long)
                    for r, s in enumerate(seqs):
                        ids[r, : len(s)] = s
                        attn[r, : len(s)] = 1
                    step = target(ids.to(device), attention_mask=attn.to(device), with_logits=False)
                    for r, (i, s) in enumerate(zip(idx, seqs)):
                        tensors[f"taps.{i}"] = step.taps[r, : len(s)].to(CACHE_DTYPE).cpu().contiguous()
                        tensors[f"last_hidden.{i}"] = (
                            step.last_hidden[r, : len(s)].to(CACHE_DTYPE).cpu().contiguous()
                        )
                    bar.update(sum(len(s) for s in seqs))
                atomic_save_safetensors(
                    cache_dir / fname, tensors, {"split": name, "first": str(lo), "last": str(hi)}
                )
    finally:
        bar.close()
    manifest["complete"] = True
    atomic_write_json(manifest_path, manifest)
    return manifest


class FeatureCache:
    """Read side: opened lazily (per worker), checked against the target fingerprint and the tokens."""

    def __init__(
        self, cache_dir: str | Path, split: str, expected: dict | None, tokens: TokenSplit | None = None
    ):
        self.dir = Path(cache_dir)
        path = self.dir / MANIFEST
        if not path.exists():
            raise DataError(
                f"no offline cache at {self.dir}: build it with python -m dspark.prepare "
                f"data.offline_cache=true "
                f"(same target and data), or train with features=online"
            )
        manifest = read_json(path)
        if not manifest.get("complete"):
            raise DataError(
                f"the offline cache at {self.dir} is incomplete: rerun python -m dspark.prepare to finish it"
            )
        if expected is not None:
            check_manifest(manifest, expected, self.dir)
        if split not in manifest["splits"]:
            raise DataError(f"the offline cache at {self.dir} has no '{split}' split")
        info = manifest["splits"][split]
        if tokens is not None and info["tokens"] != tokens_digest(tokens):
            raise CacheMismatch(
                f"the offline cache at {self.dir} was built from other tokens than {split}; rebuild it"
            )
        self.manifest = manifest
        self.split = split
        self.shard_size = int(info["shard_size"])
        self.shards = info["shards"]
        self._open: dict[int, object] = {}

    def __getstate__(self) -> dict:  # file handles are not picklable: reopen in each worker
        return {k: v for k, v in self.__dict__.items() if k != "_open"} | {"_open": {}}

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors import safe_open

        k = i // self.shard_size
        if k not in self._open:
            self._open[k] = safe_open(str(self.dir / self.shards[k]), framework="pt")
        f = self._open[k]
        return f.get_tensor(f"taps.{i}"), f.get_tensor(f"last_hidden.{i}")
