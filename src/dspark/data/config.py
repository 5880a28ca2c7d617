"""The data config (conf/data/*.yaml) as a schema (dspark.core.schema): every key prepare and train
read, with its type and range, checked before the target loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from ..core.errors import ConfigError
from ..core.schema import Count, Fraction, Natural, NonNegative, Positive, Probability, Range
from .generation import ENGINE_CHOICES


@dataclass
class Topic:
    domain: str
    weight: Natural = 1
    system: str | None = None


@dataclass
class SelfGenerated:
    max_new_tokens: Count = 48
    salvage_unfinished: bool = True
    temperature: NonNegative = 1.0
    top_p: Probability = 0.95
    top_k: Natural = 0
    batch_size: Count = 64
    max_candidates_factor: Positive = 2.0
    topics: list[Topic] = field(default_factory=list)

    def __post_init__(self):
        if self.topics and not any(t.weight for t in self.topics):
            raise ConfigError("every topic has weight 0: give one a weight >= 1")


@dataclass
class JsonlSource:
    path: str | None = None


@dataclass
class HubSource:
    name: str | None = None
    config: str | None = None
    split: str = "train"
    field: str | None = None


@dataclass
class DataConfig:
    name: str
    dir: str
    source: Literal["self_generated", "jsonl", "hub"]
    num_prompts: Count
    val_fraction: Fraction
    seed: int
    max_length: Annotated[int, Range(ge=2)]  # tokens kept of a conversation
    max_prompt_length: Count | None = None
    min_prompt_chars: Natural = 8
    max_prompt_chars: Count = 4000
    max_new_tokens: Count | None = None  # null: target.generation.max_new_tokens
    benchmark_dir: str | None = None
    strict: bool = False
    engine: Literal[ENGINE_CHOICES] = "auto"
    engine_compile: bool = False
    gen_batch_size: Count = 64
    cpu_threads: Literal["auto"] | Count = "auto"
    tokenize_workers: Literal["auto"] | Count = "auto"
    shard_size: Count = 32
    batch_size: Count = 4
    global_batch_size: Count | None = None
    anchors_per_sequence: Literal["auto"] | Count | None = None
    num_workers: Natural = 0
    bucket_batches: Count = 16
    extra_dirs: list[str] = field(default_factory=list)  # prepared folders whose training splits join dir's
    offline_cache: bool = False
    cache_max_gb: Positive = 20.0
    cache_batch_size: Count = 8
    cache_shard_size: Count = 64
    self_generated: SelfGenerated = field(default_factory=SelfGenerated)
    jsonl: JsonlSource = field(default_factory=JsonlSource)
    hub: HubSource = field(default_factory=HubSource)

    def __post_init__(self):
        if self.max_prompt_length is not None and self.max_prompt_length >= self.max_length:
            raise ConfigError(
                f"max_prompt_length={self.max_prompt_length} leaves no room for an answer in "
                f"max_length={self.max_length}: lower it or raise max_length"
            )
        if self.min_prompt_chars > self.max_prompt_chars:
            raise ConfigError(
                f"min_prompt_chars={self.min_prompt_chars} > max_prompt_chars={self.max_prompt_chars}: "
                f"no prompt could pass"
            )
        if self.source == "jsonl" and not self.jsonl.path:
            raise ConfigError("source=jsonl needs jsonl.path=<file.jsonl>")
        if self.source == "hub" and not self.hub.name:
            raise ConfigError("source=hub needs hub.name=<dataset id>")
        if self.offline_cache and self.extra_dirs:
            raise ConfigError(
                "data.extra_dirs joins training splits for online features only (a feature cache is "
                "one folder's): drop data.offline_cache, or data.extra_dirs"
            )
        if self.val_fraction > 0 and self.num_prompts < 2:
            raise ConfigError(f"num_prompts={self.num_prompts} cannot be split with val_fraction > 0")
