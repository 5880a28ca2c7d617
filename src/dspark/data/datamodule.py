"""DraftDataModule: tokenised conversations (and optionally cached target features) as batches.

Batch contract (dict):
  input_ids    [B, T] long   right-padded with the tokenizer's pad id
  attention_mask [B, T] long 1 on real tokens
  loss_mask    [B, T] bool   assistant tokens (content + its end-of-turn marker)
  lengths      [B] long      real length of each row
  taps         [B, T, m*d]   offline mode only: cached tap features (bf16; zeros on padding)
  last_hidden  [B, T, d]     offline mode only: cached final hidden states (bf16; zeros on padding)
In online mode the training step computes taps/last_hidden with `Target.features(input_ids)`:
under causal attention right padding leaves the real positions' features unchanged, so no mask.
"""

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler

from ..core.errors import DataError
from ..core.phases import phase
from ..decoding.draft_vocab import answer_token_counts
from .cache import FeatureCache
from .io import resolve_path
from .tokenize import TokenSplit, load_tokens
from .union import join_splits

log = logging.getLogger(__name__)


def tokens_path(data_dir: str | Path, split: str) -> Path:
    return Path(data_dir) / "tokens" / f"{split}.safetensors"


class ConversationDataset(Dataset):
    def __init__(self, tokens: TokenSplit, cache: FeatureCache | None = None):
        self.tokens = tokens
        self.cache = cache
        self.lengths = tokens.lengths.tolist()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        ids, mask = self.tokens.sample(i)
        item = {"input_ids": ids, "loss_mask": mask}
        if self.cache is not None:
            taps, last = self.cache.get(i)
            if taps.shape[0] != ids.shape[0]:
                raise DataError(
                    f"cached features of sample {i} have {taps.shape[0]} positions, tokens {ids.shape[0]}"
                )
            item["taps"], item["last_hidden"] = taps, last
        return item


def _worker_context(workers: int):
    """The start method of the loader's workers, named rather than inherited: inside a joblib (loky)
    worker, which Hydra's joblib launcher runs each sweep job in, the inherited default is loky's,
    whose launcher cannot start the loader's plain processes (AttributeError: 'Process' object has
    no attribute 'env')."""
    if workers <= 0:
        return None
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method)


def collate(samples: list[dict], pad_id: int) -> dict:
    lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.long)
    B, T = len(samples), int(lengths.max())
    batch = {
        "input_ids": torch.full((B, T), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((B, T), dtype=torch.long),
        "loss_mask": torch.zeros((B, T), dtype=torch.bool),
        "lengths": lengths,
    }
    for key in ("taps", "last_hidden"):
        if key in samples[0]:
            ref = samples[0][key]
            batch[key] = torch.zeros((B, T, ref.shape[-1]), dtype=ref.dtype)
    for r, s in enumerate(samples):
        n = len(s["input_ids"])
        batch["input_ids"][r, :n] = s["input_ids"]
        batch["attention_mask"][r, :n] = 1
        batch["loss_mask"][r, :n] = s["loss_mask"]
        for key in ("taps", "last_hidden"):
            if key in batch:
                batch[key][r, :n] = s[key]
    return batch


class SeededRandomSampler(RandomSampler):
    """A permutation fixed by (seed, epoch). Subclasses RandomSampler so Lightning sees a shuffled
    loader (and, under DDP, swaps in a seeded DistributedSampler for it)."""

    def __init__(self, data_source, seed: int = 0):
        super().__init__(data_source)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(len(self.data_source), generator=g).tolist())


class LengthSortedSampler(Sampler):
    def __init__(self, lengths: list[int]):
        self.lengths = lengths

    def __iter__(self):
        return iter(sorted(range(len(self.lengths)), key=lambda i: self.lengths[i]))

    def __len__(self) -> int:
        return len(self.lengths)


class BucketBatchSampler(BatchSampler):
    """Length bucketing: take `bucket_batches` batches' worth of indices from the (shuffled) sampler,
    sort them by length, cut into batches, and shuffle the batch order (seeded by the sampler's
    epoch), so a batch holds similar lengths (little padding) while the epoch stays random."""

    def __init__(
        self,
        sampler,
        batch_size: int,
        drop_last: bool,
        lengths: list[int] | None = None,
        bucket_batches: int = 16,
        seed: int = 0,
    ):
        super().__init__(sampler, batch_size, drop_last)
        if lengths is None:
            raise ValueError("BucketBatchSampler needs the sample lengths")
        self.lengths = lengths
        self.bucket_batches = max(1, int(bucket_batches))
        self.seed = int(seed)

    def _batches(self) -> list[list[int]]:
        indices = list(iter(self.sampler))
        pool = self.batch_size * self.bucket_batches
        batches: list[list[int]] = []
        for start in range(0, len(indices), pool):
            chunk = sorted(indices[start : start + pool], key=lambda i: self.lengths[i])
            batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        epoch = getattr(self.sampler, "epoch", 0)
        g = torch.Generator().manual_seed(self.seed * 7919 + int(epoch) + 1)
        return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


class GlobalBatchSampler(Sampler):
    """Distributed, accumulation-aware batches: one rank's micro-batches of a global batch.

    Global batches of `micro_batch_size × world_size × accumulate` indices come from a
    `BucketBatchSampler` over a seeded permutation (the same on every rank). Each global batch is
    cut into M = world_size × accumulate micro-batches by striding through it (micro j holds
    positions j, j+M, j+2M…, so every micro-batch spans the bucket's lengths and ranks stay in
    step); rank r's accumulation step a gets micro j = a·world_size + r. Hence a 2-rank run
    (accumulate 1) and a 1-rank run with accumulate 2 see exactly the same samples per optimizer
    step. An incomplete last global batch is dropped (less than one global batch of samples per
    epoch): every rank has the same number of batches, an epoch ends on an optimizer step, and every
    step has the same batch size. A smaller batch would recompile the compiled layers for its size
    and leave their batch dimension dynamic: a 37 s stall at step 585 of a 12-minute H200 run, whose
    88 200 training conversations left a batch of 8 among the 64s."""

    def __init__(
        self,
        data_source,
        lengths: list[int],
        micro_batch_size: int,
        world_size: int = 1,
        rank: int = 0,
        accumulate: int = 1,
        bucket_batches: int = 16,
        seed: int = 0,
        steps=None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.world_size, self.rank, self.accumulate = int(world_size), int(rank), max(1, int(accumulate))
        self.micro_batch_size = int(micro_batch_size)
        self.num_micro = self.world_size * self.accumulate
        self.sampler = SeededRandomSampler(data_source, seed)  # Lightning calls its set_epoch
        self.global_batches = BucketBatchSampler(
            self.sampler,
            self.micro_batch_size * self.num_micro,
            drop_last=True,
            lengths=lengths,
            bucket_batches=bucket_batches,
            seed=seed,
        )
        self.steps = steps  # () -> optimizer steps taken so far, or None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.global_batches)

    def micro_index(self, step_in_accumulation: int) -> int:
        return step_in_accumulation * self.world_size + self.rank

    def __iter__(self):
        skip = 0
        if self.steps is not None and self.steps_per_epoch:  # the position follows the optimizer step
            epoch, skip = divmod(int(self.steps()), self.steps_per_epoch)
            self.sampler.set_epoch(epoch)
        for batch in itertools.islice(self.global_batches, skip, None):
            for a in range(self.accumulate):
                yield batch[self.micro_index(a) :: self.num_micro]

    def __len__(self) -> int:
        return len(self.global_batches) * self.accumulate

    def state_dict(self) -> dict:
        """What the position depends on besides the step (recorded in the checkpoint)."""
        sampler = self.sampler
        return {"samples": len(sampler), "steps_per_epoch": self.steps_per_epoch, "seed": sampler.seed}

    def load_state_dict(self, state: dict) -> None:
        if state and state != self.state_dict():
            log.warning(
                "the training batches differ from the checkpoint's (%s, now %s): the run resumes at its "
                "step, but not on the batches the uninterrupted run would have taken",
                state,
                self.state_dict(),
            )


class ResumableLoader(DataLoader):
    """A DataLoader Lightning records in its checkpoints (its batch sampler's state), so it knows
    the loader resumes mid-epoch (GlobalBatchSampler follows the optimizer step)."""

    def state_dict(self) -> dict:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)


def anchor_positions(split) -> torch.Tensor:
    """[conversations] of a token split: each one's positions a with loss_mask[a] and loss_mask[a+1],
    where a training block can start (``drafters.dflash.sample_anchors``' rule)."""
    mask = split.loss_mask.bool()
    starts = mask[:-1] & mask[1:]
    ends = split.offsets[1:-1] - 1
    starts[ends[ends >= 0]] = False  # a pair across two conversations is no anchor
    before = torch.cat([torch.zeros(1, dtype=torch.long), starts.long().cumsum(0)])
    edges = split.offsets.clamp(max=starts.numel())
    return before[edges[1:]] - before[edges[:-1]]


class DraftDataModule(L.LightningDataModule):
    """Train/val batches from a prepared `data.dir` (see dspark.data.dataset).

    features: "online" (tokens only) or "offline" (tokens + cached target features; the cache is
    checked against `target_fingerprint`, see cache.target_fingerprint(target)). The folder must be
    prepared already (training calls dspark.data.dataset.ensure_dataset first)."""

    def __init__(
        self,
        cfg_data,
        features: str = "online",
        target_fingerprint: dict | None = None,
        pad_token_id: int | None = None,
    ):
        super().__init__()
        if features not in ("online", "offline"):
            raise DataError(f"features must be 'online' or 'offline', got '{features}'")
        self.cfg = cfg_data
        self.dir = resolve_path(cfg_data.dir)
        self.features = features
        self.fingerprint = target_fingerprint
        self.pad_token_id = pad_token_id
        self.batch_size = int(cfg_data.batch_size)
        self.seed = int(cfg_data.get("seed", 0))
        self.datasets: dict[str, ConversationDataset] = {}
        self._token_counts: dict[int, torch.Tensor] = {}  # answer_token_counts, by vocabulary size
        # Real tokens of the training batches sent to the device so far, summed on the host from
        # the rows' lengths before each transfer: the throughput reads it (callbacks.Throughput)
        # instead of reading a device sum back, which would wait for the device.
        self.train_tokens = 0

    def _load(self, split: str) -> ConversationDataset:
        if split not in self.datasets:
            tokens = load_tokens(tokens_path(self.dir, split))
            extras = self.cfg.get("extra_dirs") or []
            if split == "train" and extras:
                joined = {str(d): load_tokens(tokens_path(resolve_path(d), "train")) for d in extras}
                tokens = join_splits(tokens, joined, held_out=self._load("val").tokens)
            if self.pad_token_id is None:
                self.pad_token_id = int(tokens.meta["pad_token_id"])
            cache = None
            if self.features == "offline":
                cache = FeatureCache(self.dir / "cache", split, self.fingerprint, tokens)
            self.datasets[split] = ConversationDataset(tokens, cache)
        return self.datasets[split]

    def setup(self, stage: str | None = None) -> None:
        self._load("train")
        self._load("val")

    def most_anchor_positions(self) -> int:
        """The most anchor positions any training conversation has (its joined sets included): what
        ``data.anchors_per_sequence=auto`` sizes the training step's anchors by."""
        counts = anchor_positions(self._load("train").tokens)
        return int(counts.max()) if counts.numel() else 0

    def answer_token_counts(self, vocab_size: int):
        """How often each token id occurs in the training split's answers (its joined sets
        included): what a draft vocabulary is chosen from (``decoding.draft_vocab``). Counted once:
        training's draft vocabulary and the drafter folder's counts file both read them."""
        if vocab_size not in self._token_counts:
            self._token_counts[vocab_size] = answer_token_counts([self._load("train").tokens], vocab_size)
        return self._token_counts[vocab_size]

    def transfer_batch_to_device(self, batch, device, dataloader_idx: int):
        trainer = self.trainer
        if trainer is not None and trainer.training and "lengths" in batch:
            self.train_tokens += int(batch["lengths"].sum())  # still in host memory here
        with phase("data_to_device"):  # a profiler range (core.phases); nothing without a profiler
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _pin_memory(self) -> bool:
        """Batches in page-locked memory when they go to a GPU: Lightning copies them with
        non_blocking=True, which is asynchronous only from pinned memory (from pageable memory
        the driver stages the copy and may wait for the stream: the host could not run ahead)."""
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def _world(self) -> tuple[int, int, int]:
        """(world_size, global rank, accumulate_grad_batches) of the attached trainer (1, 0, 1 without)."""
        trainer = self.trainer
        if trainer is None:
            return 1, 0, 1
        return int(trainer.world_size), int(trainer.global_rank), int(trainer.accumulate_grad_batches)

    def train_dataloader(self) -> DataLoader:
        ds = self._load("train")
        world, rank, accumulate = self._world()
        sampler = GlobalBatchSampler(
            ds,
            ds.lengths,
            self.batch_size,
            world_size=world,
            rank=rank,
            accumulate=accumulate,
            bucket_batches=int(self.cfg.get("bucket_batches", 16)),
            seed=self.seed,
            steps=(lambda: self.trainer.global_step) if self.trainer is not None else None,
        )
        if len(sampler) == 0:
            raise DataError(
                f"{len(ds)} training samples make no full global batch of "
                f"{self.batch_size * world * accumulate} (data.batch_size × devices × accumulation): "
                f"prepare more data (data.num_prompts) or lower data.global_batch_size"
            )
        return self._loader(ds, sampler, ResumableLoader)

    def val_dataloader(self) -> DataLoader:
        ds = self._load("val")
        # Fixed order, sorted by length: little padding, and the same batches every validation.
        batches = list(BatchSampler(LengthSortedSampler(ds.lengths), self.batch_size, False))
        world, rank, _ = self._world()
        if world > 1:
            # Rank r takes batches r, r+W, …; every rank runs the same number of batches (a sharded
            # model needs every rank in each forward), so a remainder of < W batches is left out.
            usable = len(batches) // world * world
            if usable < len(batches):
                log.info("validation: %d of %d batches used on %d ranks", usable, len(batches), world)
            batches = batches[rank:usable:world]
        return self._loader(ds, batches)

    def _loader(self, ds: Dataset, batch_sampler, kind: type[DataLoader] = DataLoader) -> DataLoader:
        workers = int(self.cfg.get("num_workers", 0))
        # A partial of a module-level function pickles cheaply into worker processes.
        collate_fn = functools.partial(collate, pad_id=int(self.pad_token_id))
        return kind(
            ds,
            batch_sampler=batch_sampler,
            collate_fn=collate_fn,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=self._pin_memory(),
            multiprocessing_context=_worker_context(workers),
        )
