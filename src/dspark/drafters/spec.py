"""What a drafter checkpoint is, read from its config alone (no weights, no model): the facts the
entry points check a run against before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .registry import drafter_class

__all__ = ["DrafterSpec"]


@dataclass(frozen=True)
class DrafterSpec:
    kind: str  # registry name: dspark, dflash, eagle3, …
    head: str  # sequential head, "none" without one
    gamma: int  # draft tokens per proposal (the drafter class's ``config_gamma``)
    has_confidence: bool
    supports_static_cache: bool  # can run on engine=fast
    config: dict = field(repr=False)  # the checkpoint's config (ours, or translated from a foreign one)

    @property
    def label(self) -> str:
        """How results name the drafter: ``dspark-markov``, ``dflash``, …"""
        return self.kind if self.head == "none" else f"{self.kind}-{self.head}"

    @property
    def target(self) -> dict[str, Any]:
        """What the checkpoint records of its target (name, layer_ids, …)."""
        return dict(self.config.get("target") or {})

    @classmethod
    def from_config(cls, config: dict) -> DrafterSpec:
        """From a checkpoint config in our schema (drafter / head / dims / target)."""
        drafter = config["drafter"]
        impl = drafter_class(drafter["name"])
        return cls(
            kind=impl.kind,
            head=(config.get("head") or {}).get("name") or "none",
            gamma=impl.config_gamma(drafter),
            has_confidence=impl.config_has_confidence(drafter),
            supports_static_cache=impl.supports_static_cache,
            config=config,
        )
