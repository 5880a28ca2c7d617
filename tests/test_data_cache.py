"""Offline target cache and DraftDataModule: batch contract, deterministic shuffling, length
bucketing, offline features equal to online ones, refusal of foreign or oversized caches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import CONF
from omegaconf import OmegaConf

from dspark.core.errors import DataError
from dspark.data.cache import CacheMismatch, FeatureCache, build_cache, target_fingerprint
from dspark.data.datamodule import BucketBatchSampler, DraftDataModule, SeededRandomSampler, tokens_path
from dspark.data.tokenize import load_tokens
from dspark.target import load_target


def target_cfg(name: str, **over):
    cfg = OmegaConf.load(CONF / "target" / f"{name}.yaml")
    cfg.device = "cpu"
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return tiny_target  # conftest's session-wide tiny target (one torch thread)


@pytest.fixture(scope="module")
def dataset(tiny, tmp_path_factory):
    """A prepared folder (tiny target, local prompts of varied length) with an offline cache."""
    from dspark.data.dataset import prepare_dataset

    tmp = tmp_path_factory.mktemp("ds")
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
    ]
    rows = [{"turns": [f"Prompt {i}: " + " ".join(words[: 1 + (i * 5) % 12])]} for i in range(24)]
    (tmp / "src.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = OmegaConf.load(CONF / "data" / "quick.yaml")
    over = {
        "dir": str(tmp / "data"),
        "source": "jsonl",
        "jsonl": {"path": str(tmp / "src.jsonl")},
        "num_prompts": 24,
        "val_fraction": 0.25,
        "max_new_tokens": 10,
        "shard_size": 8,
        "benchmark_dir": None,
        "offline_cache": True,
        "cache_shard_size": 5,
        "cache_batch_size": 4,
        "batch_size": 3,
        "bucket_batches": 2,
    }
    cfg = OmegaConf.merge(cfg, over)
    prepare_dataset(cfg, target_cfg("tiny"), target=tiny)
    return cfg


def test_batch_contract_online(dataset):
    dm = DraftDataModule(dataset, features="online")
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    B, T = batch["input_ids"].shape
    assert B == 3 and set(batch) == {"input_ids", "attention_mask", "loss_mask", "lengths"}
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.bool and batch["loss_mask"].shape == (B, T)
    assert int(batch["lengths"].max()) == T
    assert torch.equal(batch["attention_mask"].sum(1), batch["lengths"])
    pad = load_tokens(tokens_path(dataset.dir, "train")).meta["pad_token_id"]
    assert (batch["input_ids"][batch["attention_mask"] == 0] == pad).all()  # right padding with the pad id
    assert not batch["loss_mask"][batch["attention_mask"] == 0].any()
    for r in range(B):  # padding only at the right
        n = int(batch["lengths"][r])
        assert batch["attention_mask"][r, :n].all() and not batch["attention_mask"][r, n:].any()
    assert sum(len(b["input_ids"]) for b in dm.val_dataloader()) == len(dm.datasets["val"]) == 6


def epoch_batches(dm, epoch: int) -> list[list[int]]:
    loader = dm.train_dataloader()
    loader.batch_sampler.sampler.set_epoch(epoch)
    return [b for b in loader.batch_sampler]


def test_batches_are_pinned_only_for_a_gpu(dataset):
    """Lightning copies batches with non_blocking=True, asynchronous only from page-locked memory."""
    from types import SimpleNamespace

    dm = DraftDataModule(dataset, features="online")
    dm.setup("fit")
    assert not dm.train_dataloader().pin_memory and not dm.val_dataloader().pin_memory  # no trainer
    for kind, pinned in (("cpu", False), ("cuda", True)):
        dm.trainer = SimpleNamespace(
            strategy=SimpleNamespace(root_device=torch.device(kind)), world_size=1, global_rank=0,
            accumulate_grad_batches=1, global_step=0,
        )  # fmt: skip
        assert dm.train_dataloader().pin_memory is pinned and dm.val_dataloader().pin_memory is pinned


def test_shuffling_is_deterministic_and_bucketed(dataset):
    a, b = DraftDataModule(dataset), DraftDataModule(dataset)
    a.setup(), b.setup()
    e0 = epoch_batches(a, 0)
    assert e0 == epoch_batches(b, 0)  # same seed, same batches
    assert e0 != epoch_batches(a, 1)  # a new epoch reshuffles
    assert sorted(i for batch in e0 for i in batch) == list(range(len(a.datasets["train"])))
    other = DraftDataModule(OmegaConf.merge(dataset, {"seed": 1}))
    other.setup()
    assert epoch_batches(other, 0) != e0
    # Bucketing: within each pool of bucket_batches batches the lengths come sorted.
    lengths = a.datasets["train"].lengths
    sampler = BucketBatchSampler(SeededRandomSampler(range(18), seed=0), 3, False, lengths, bucket_batches=2)
    pool_order = list(iter(sampler.sampler))
    for start in range(0, 18, 6):
        pool = pool_order[start : start + 6]
        expected = sorted(pool, key=lambda i: lengths[i])
        batches = [bt for bt in sampler if set(bt) <= set(pool)]
        assert sorted(batches) == sorted([expected[:3], expected[3:]])


def test_offline_features_equal_online(tiny, dataset):
    """The cached taps/last_hidden of a batch match Target.forward on that batch (bf16 tolerance), and so
    does the target's next-token loss computed from them."""
    dm = DraftDataModule(dataset, features="offline", target_fingerprint=target_fingerprint(tiny))
    dm.setup()
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        batch = next(iter(loader))
        B, T = batch["input_ids"].shape
        assert batch["taps"].shape == (B, T, tiny.tap_dim) and batch["taps"].dtype == torch.bfloat16
        assert batch["last_hidden"].shape == (B, T, tiny.hidden_size)
        online = tiny(batch["input_ids"], attention_mask=batch["attention_mask"], with_logits=True)
        real = batch["attention_mask"].bool()
        torch.testing.assert_close(batch["taps"].float()[real], online.taps[real], rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(
            batch["last_hidden"].float()[real], online.last_hidden[real], rtol=1.6e-2, atol=1e-2
        )
        assert not batch["taps"][~real].any()

        def target_loss(last_hidden, batch=batch):
            logits = tiny.lm_head(last_hidden.to(tiny.dtype))[:, :-1]
            mask = batch["loss_mask"][:, 1:]
            return torch.nn.functional.cross_entropy(logits[mask], batch["input_ids"][:, 1:][mask])

        torch.testing.assert_close(
            target_loss(batch["last_hidden"]), target_loss(online.last_hidden), rtol=1e-2, atol=1e-2
        )


def test_cache_from_another_target_is_refused(tiny, dataset):
    cache_dir = Path(dataset.dir) / "cache"
    other = target_fingerprint(tiny) | {"layer_ids": [0, 2]}
    with pytest.raises(CacheMismatch, match="built for another target.*layer_ids"):
        FeatureCache(cache_dir, "train", other)
    with pytest.raises(CacheMismatch, match="fingerprint"):
        DraftDataModule(dataset, "offline", target_fingerprint(tiny) | {"fingerprint": "qwen3_4b"}).setup()
    # Building into it with a different target is refused too, before anything is written.
    other_target = load_target(target_cfg("tiny", layer_ids=[0, 2]))
    splits = {s: load_tokens(tokens_path(dataset.dir, s)) for s in ("train", "val")}
    with pytest.raises(CacheMismatch):
        build_cache(other_target, splits, cache_dir)
    from dspark.data.dataset import ensure_dataset

    with pytest.raises(CacheMismatch):
        ensure_dataset(dataset, target_cfg("tiny", layer_ids=[0, 2]), target=other_target, features="offline")


def test_cache_size_estimate_and_max_gb(tiny, dataset, tmp_path, capsys):
    splits = {s: load_tokens(tokens_path(dataset.dir, s)) for s in ("train", "val")}
    with pytest.raises(DataError, match="cache_max_gb"):
        build_cache(tiny, splits, tmp_path / "c", max_gb=1e-6)
    out = capsys.readouterr().out
    tokens = sum(int(s.offsets[-1]) for s in splits.values())
    assert f"offline cache: {tokens} tokens x {(3 + 1) * 64 * 2} B/token" in out
    assert not (tmp_path / "c").exists()  # refused before writing anything


def test_missing_or_incomplete_cache_is_reported(tiny, dataset, tmp_path):
    with pytest.raises(DataError, match="no offline cache"):
        FeatureCache(tmp_path, "train", target_fingerprint(tiny))
    manifest = json.loads((Path(dataset.dir) / "cache" / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps(manifest | {"complete": False}))
    with pytest.raises(DataError, match="incomplete"):
        FeatureCache(tmp_path, "train", target_fingerprint(tiny))
