"""The engines of an evaluation: the calibration rollouts (full blocks, raw confidences, so every
position gets a label and STS starts from scratch) and the benchmark rollouts, which use the fitted
or the checkpoint's temperatures. Each benchmark gets its own seeded generator, so its result does
not depend on which other benchmarks run."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import Tensor

from ..artifacts import DrafterFolder, EvaluationFolder
from ..calibration.sts import Calibration
from ..checkpoints import load_drafter
from ..core.errors import ConfigError
from ..data.vocab_counts import load_draft_vocab, served_vocab_size
from ..decoding.engine import Engine, Generation, Request, RoundRecord, calibration_arrays
from ..decoding.fast_engine import build_engine, cache_capacity
from ..scheduling.cost import CostModel
from ..scheduling.policies import Fixed, Policy, build_policy

log = logging.getLogger(__name__)


@dataclass
class CalibrationFit:
    calibration: Calibration
    z: Tensor  # the rollouts' confidence logits [N, γ], prefix-acceptance labels and validity
    y: Tensor
    valid: Tensor
    rounds: int
    prompts: int


@dataclass
class Rollouts:
    """The benchmark rollouts, per benchmark."""

    rounds: dict[str, list[RoundRecord]]
    generations: dict[str, list[Generation]]
    timing: dict[str, dict]


def requests(target, prompts: Iterable[tuple[str, str]]) -> list[Request]:
    """Engine requests from ``(id, user turn)`` pairs, through the target's one prompt function."""
    return [Request(prompt=target.prompt_ids(text), id=rid) for rid, text in prompts]


class Evaluator:
    def __init__(
        self, cfg: DictConfig, target, drafter, calibration, policy: Policy, cost,
        draft_vocab: Tensor | None = None, vocab_coverage: float = 1.0,
    ):  # fmt: skip
        self.cfg, self.target, self.drafter = cfg, target, drafter
        self.calibration, self.policy, self.cost = calibration, policy, cost
        # The drafter's draft vocabulary (None: the whole) and the share of its training answers'
        # tokens that it holds.
        self.draft_vocab, self.vocab_coverage = draft_vocab, vocab_coverage
        self.longest: int | None = None  # the longest prompt + budget of the run (check_context)

    @classmethod
    def load(cls, cfg: DictConfig, target) -> Evaluator:
        """The drafter of ``cfg.drafter_dir`` with its temperatures, the policy and its cost model."""
        drafter, _ = load_drafter(cfg.drafter_dir, target, device=target.device)
        calibration = DrafterFolder(str(cfg.drafter_dir)).read_calibration()
        cost = CostModel.load(cfg.policy.cost_table) if cfg.policy.get("cost_table") else None
        vocab, coverage = load_draft_vocab(
            cfg.drafter_dir, served_vocab_size(cfg.get("draft_vocab"), cfg.drafter_dir), target.vocab_size,
            target.eos_token_ids,
            cfg.get("draft_vocab_counts"),
        )  # fmt: skip
        return cls(cfg, target, drafter, calibration, build_policy(cfg.policy), cost, vocab, coverage)

    def check_context(self, report: dict[str, list[str]], held_out: list[tuple[str, str]]) -> None:
        """Before any decoding: every prompt with its answer budget fits the target's context
        (ConfigError naming the first that does not). Records the longest, which sizes every
        engine of the run alike (``engine``)."""
        context, cfg = self.target.context_length, self.cfg
        budget = int(cfg.max_new_tokens)
        held_budget = int(cfg.calibration.get("max_new_tokens") or budget)
        items = [(f"{b} prompt {i}", p, budget) for b, ps in report.items() for i, p in enumerate(ps)]
        items += [(f"calibration prompt {i} ({b})", p, held_budget) for i, (b, p) in enumerate(held_out)]
        self.longest = 0
        for label, text, new in items:
            n = len(self.target.prompt_ids(text))
            self.longest = max(self.longest, n + new)
            if context is not None and n + new > context:
                raise ConfigError(
                    f"{label} is {n} tokens: with {new} new tokens it exceeds target {self.target.name}'s "
                    f"context of {context}: lower max_new_tokens, or leave the prompt out"
                )

    def engine(self, policy: Policy, calibration, name: str) -> Engine:
        cfg = self.cfg
        gen = torch.Generator().manual_seed(int(cfg.seed) * 1_000_003 + zlib.crc32(name.encode()))
        kind = str(cfg.get("engine", "plain"))
        fast = {}
        if kind == "fast":
            fast["compile"] = cfg.get("engine_compile")  # null: on CUDA
            if self.longest:  # one cache shape for the calibration and every benchmark
                fast["capacity"] = cache_capacity(self.longest, getattr(self.drafter, "gamma", 0))
        return build_engine(
            kind,
            self.target,
            self.drafter,
            policy,
            temperature=float(cfg.temperature),
            concurrency=int(cfg.concurrency),
            max_new_tokens=int(cfg.max_new_tokens),
            calibration=calibration,
            cost=self.cost,
            generator=gen,
            progress=bool(cfg.progress),
            desc=name,
            draft_vocab=self.draft_vocab,
            **fast,
        )

    def calibrate(self, prompts: list[tuple[str, str]]) -> CalibrationFit:
        """Fit STS (``calibration.offsets``: STS with offsets) on rollouts of the held-out ``(benchmark,
        prompt)`` pairs; later rollouts use it."""
        reqs = requests(self.target, ((f"calibration/{b}/{i}", p) for i, (b, p) in enumerate(prompts)))
        engine = self.engine(Fixed(None), None, "calibration")
        if self.cfg.calibration.get("max_new_tokens"):
            engine.max_new_tokens = int(self.cfg.calibration.max_new_tokens)
        res = engine.generate(reqs)
        z, y, valid = calibration_arrays(res.rounds)
        cal = self.cfg.calibration
        if cal.get("offsets"):
            self.calibration = Calibration.fit(z, y, valid, offsets=True)
        else:
            self.calibration = Calibration.fit(z, y, valid, n_bins=int(cal.n_bins))
        log.info("%s from %d calibration rounds", self.calibration, len(res.rounds))
        return CalibrationFit(self.calibration, z, y, valid, len(res.rounds), len(reqs))

    def decode(self, prompts: dict[str, list[str]], folder: EvaluationFolder) -> Rollouts:
        """Each benchmark's prompts through the engine; every round and generation recorded."""
        out = Rollouts({}, {}, {})
        with folder.recorder() as (write_round, write_generation):
            for name, texts in prompts.items():
                reqs = requests(self.target, ((f"{name}/{i}", p) for i, p in enumerate(texts)))
                res = self.engine(self.policy, self.calibration, name).generate(reqs)
                out.rounds[name], out.generations[name] = res.rounds, res.generations
                out.timing[name] = {
                    "wall_s": res.wall_s,
                    "new_tokens": res.new_tokens,
                    "tokens_per_s": res.new_tokens / res.wall_s if res.wall_s else None,
                }
                for r in res.rounds:
                    write_round({"benchmark": name, **r.to_dict()})
                for g in res.generations:
                    write_generation(
                        {
                            "benchmark": name,
                            "id": g.id,
                            "finish": g.finish,
                            "rounds": g.rounds,
                            "accepted": g.accepted,
                            "tokens": g.tokens,
                            "text": _decode(self.target.tokenizer, g.tokens),
                        }
                    )
        return out


def _decode(tokenizer, tokens: list[int]) -> str | None:
    # Clean-up rewrites spaces around punctuation in BPE text (and transformers warns about it).
    return tokenizer.decode(tokens, clean_up_tokenization_spaces=False) if tokenizer is not None else None
