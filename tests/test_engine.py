"""The batched engine (dspark.decoding.engine): losslessness end to end, greedy parity,
bookkeeping, continuous batching, calibration temperatures.

Statistical tests use fixed seeds and a small-vocabulary variant of the tiny target (the tiny
config's shape, 256 tokens, initializer_range 0.5): with SmolLM2's 49k-token vocabulary the random
tiny target spreads ~8 nats over the first tokens, so a chi-square over token triples would be
almost all pooled mass; here the top triples carry most of it and the test has power (the
negative control shows it fails when verification is broken).

Partial acceptance is what exercises cache cropping, and untrained drafters are almost never
accepted, so besides every real drafter type the tests use ``Oracle``: a drafter that re-runs the
target on the committed tokens and proposes from a warped copy of its distribution (or its argmax
with random corruptions under greedy).
"""

from __future__ import annotations

import math
from collections import Counter
from functools import partial

import pytest
import torch
from conftest import load_group

from dspark.artifacts import DrafterFolder
from dspark.calibration.sts import Calibration
from dspark.checkpoints import save_drafter
from dspark.core.sampling import probs_from_logits, sample_from
from dspark.core.types import DraftCache, Proposal, TargetDims
from dspark.decoding import engine as engine_mod
from dspark.decoding.engine import (
    LAUNCH_PARTS,
    Engine,
    Request,
    calibration_arrays,
    conditional_acceptance,
    packed_copies,
    retire_order,
    threshold_sweep,
)
from dspark.decoding.fast_engine import build_engine
from dspark.decoding.kv import RaggedKV
from dspark.decoding.verify import VerifyResult
from dspark.drafters import Drafter, build_drafter
from dspark.scheduling.cost import CostModel
from dspark.scheduling.policies import DraftAware, Fixed, HardwareAware, Threshold, build_policy

try:
    from scipy.stats import chi2 as _chi2
except ImportError:  # pragma: no cover
    _chi2 = None

P_MIN = 1e-3


@pytest.fixture(autouse=True)
def _one_thread():
    # Small ops on a shared 2-core box: a second OpenMP thread mostly spins against other jobs.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


# ----------------------------------------------------------------------------------------------
# helpers


def make_drafter(target, name: str, head: str = "none", gamma: int = 4, seed: int = 0):
    dc, hc = load_group("drafter", name), load_group("head", head)
    dc.num_layers, dc.block_size = 1, gamma
    if name == "eagle3":
        dc.ttt_steps = gamma
    hc.rank = 16 if head != "none" else 0
    torch.manual_seed(seed)
    return build_drafter(TargetDims.of(target), dc, hc).eval(), dc, hc


BOS = 1  # every test prompt starts with it, so the oracle can rebuild position 0


class Oracle(Drafter):
    """A test drafter that rebuilds the committed tokens (BOS, then positions 1..a from
    ``next_tokens``) and re-runs the target on them: at T > 0 it samples from
    softmax(logits / (T * warp)), at T = 0 it proposes the argmax, replaced by a random token with
    probability ``corrupt``."""

    kind = "oracle"

    def __init__(self, target, gamma=4, warp=1.6, corrupt=0.3, width=256):
        super().__init__()
        self.target, self.gamma, self.warp, self.corrupt, self.width = target, gamma, warp, corrupt, width

    def train_forward(self, taps, input_ids, loss_mask, anchors, shared):
        raise NotImplementedError("the oracle only decodes")

    def new_cache(self, r, device, dtype=None, capacity=0):
        z = torch.zeros(r, dtype=torch.long, device=device)
        return DraftCache(k=[], v=[], length=z, extra={"hist": torch.zeros(r, self.width, dtype=torch.long)})

    def extend_context(self, cache, taps, positions, valid, next_tokens, shared=None):
        rows, cols = valid.nonzero(as_tuple=True)
        cache.extra["hist"][rows, cache.length[rows] + cols] = next_tokens[rows, cols]
        cache.length = cache.length + valid.sum(1)

    def propose(
        self,
        cache,
        anchor_tokens,
        anchor_pos,
        shared,
        temperature,
        generator=None,
        uniforms=None,
        draft_len=None,
    ):
        r, g = anchor_tokens.shape[0], draft_len or self.gamma
        assert torch.equal(cache.length, anchor_pos)
        u = torch.rand(r, self.gamma, generator=generator) if uniforms is None else uniforms
        flip = torch.rand(r, self.gamma, generator=generator)
        rnd = torch.randint(0, self.target.vocab_size, (r, self.gamma), generator=generator)
        lens, rows = cache.length, torch.arange(r)
        assert torch.equal(cache.extra["hist"][rows, lens - 1], anchor_tokens)
        bos = torch.full((r, 1), BOS, dtype=torch.long)
        seq = torch.cat(
            [bos, cache.extra["hist"][:, : int(lens.max())], torch.zeros(r, g, dtype=torch.long)], 1
        )
        toks, probs = [], []
        for k in range(g):
            logits = self.target(seq[:, : int(lens.max()) + 1 + k]).logits[rows, lens + k]
            if temperature == 0:
                pick = torch.where(flip[:, k] < self.corrupt, rnd[:, k], logits.argmax(-1))
                p = torch.zeros_like(logits).scatter_(1, pick[:, None], 1.0)
            else:
                p = probs_from_logits(logits, temperature * self.warp)
            t = sample_from(p, u[:, k])
            seq[rows, lens + 1 + k] = t
            toks.append(t)
            probs.append(p)
        return Proposal(tokens=torch.stack(toks, 1), probs=torch.stack(probs, 1), confidence_logits=None)


class Cycling(Fixed):
    """A test policy whose draft length changes every round with the outcomes seen so far (never
    with the round's own draft): 0 (a plain decoding round), then 1..γ positions."""

    name = "cycling"

    def __init__(self) -> None:
        super().__init__(None)
        self.seen = 0

    def draft_length(self, rows, gamma, cost=None):
        return self.seen % (gamma + 1)

    def observe_round(self, lengths, accepted):
        self.seen += 1 + int(accepted.sum()) % 2

    def reset(self):
        self.seen = 0


def prompts_for(target, n, seed=0, lo=3, hi=9):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [[BOS] + torch.randint(4, min(target.vocab_size, 1000), (m,), generator=g).tolist() for m in lens]


def hf_greedy(target, prompt, n):
    """Reference greedy decoding with Hugging Face's own DynamicCache, independent of RaggedKV."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out, ids = [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = target.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    return out


def chi2_pvalue(obs: list[float], exp: list[float]) -> float:
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    if _chi2 is not None:
        return float(_chi2.sf(stat, df))
    return float(
        torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0))
    )


def exact_triples(target, prompt, n, min_expected=5.0):
    """Exact target probabilities of the first three generated tokens at T=1 for every triple
    whose expected count among n samples is >= min_expected (the rest is pooled)."""
    base = torch.tensor(prompt)
    with torch.no_grad():
        p1 = torch.softmax(target(base[None]).logits[0, -1], -1).double()
        x1 = (p1 * n >= min_expected).nonzero().flatten()
        pre2 = torch.stack([torch.cat([base, t.view(1)]) for t in x1])
        p2 = torch.softmax(target(pre2).logits[:, -1], -1).double() * p1[x1, None]  # [K1, V] joint
        i, x2 = (p2 * n >= min_expected).nonzero(as_tuple=True)
        pre3 = torch.stack([torch.cat([base, x1[a].view(1), b.view(1)]) for a, b in zip(i, x2)])
        p3 = torch.softmax(target(pre3).logits[:, -1], -1).double() * p2[i, x2][:, None]
    cells = {}
    for row, (a, b) in enumerate(zip(i.tolist(), x2.tolist())):
        for c in (p3[row] * n >= min_expected).nonzero().flatten().tolist():
            cells[(int(x1[a]), b, c)] = float(p3[row, c])
    return cells


def assert_matches(samples: list[tuple], cells: dict, n: int, what: str) -> float:
    counts = Counter(samples)
    obs = [counts.get(k, 0) for k in cells] + [n - sum(counts.get(k, 0) for k in cells)]
    rest = 1.0 - sum(cells.values())
    exp = [p * n for p in cells.values()] + [rest * n]
    if exp[-1] < 5:  # fold a negligible pooled cell into the smallest one
        obs, exp = obs[:-1], exp[:-1]
        obs[-1] += n - sum(obs)
        exp[-1] += n - sum(exp)
    p = chi2_pvalue(obs, exp)
    assert p > P_MIN, (
        f"{what}: first-three-token distribution differs from the target's (chi-square p={p:.2e})"
    )
    return p


# ----------------------------------------------------------------------------------------------
# KV cache


def test_packed_copies_hand_back_every_tensor_from_one_copy_per_dtype():
    """A round's outcome reaches the host as one flat copy per dtype; each tensor comes back as a
    view of it with its own name, shape and values (empty ones too: a plain round's drafts)."""
    tensors = {
        "accepted": torch.tensor([0, 3, 1]),
        "drafts": torch.arange(12).view(3, 4),
        "conf": torch.rand(3, 4),
        "none": torch.zeros(3, 0, dtype=torch.long),
        "next": torch.tensor([7, 8, 9]),
    }
    copies = []

    def copy(t):
        copies.append(t.dtype)
        return t.clone()

    out = packed_copies(tensors, copy)
    assert sorted(copies, key=str) == [torch.float32, torch.int64]
    assert out.keys() == tensors.keys()
    for k, t in tensors.items():
        assert out[k].shape == t.shape and out[k].dtype == t.dtype and torch.equal(out[k], t), k


def test_ragged_kv_matches_full_forward(small_target):
    """Ragged writes, partial commits (rejected tokens left behind) and continued decoding give the
    same logits as one full forward of each committed sequence."""
    t = small_target
    seqs = prompts_for(t, 3, seed=1, lo=14, hi=20)
    kv = RaggedKV.empty(t.model.config, 3, 4, t.dtype, "cpu")
    committed = [[] for _ in seqs]
    plan = [[4, 2, 6], [3, 3, 3], [2, 4, 1]]  # tokens fed per row per step
    keep = [[4, 2, 6], [1, 3, 2], [2, 1, 1]]  # tokens kept (the rest is rejected junk)
    for fed, kept in zip(plan, keep):
        width = max(fed)
        junk = torch.tensor([[250, 251, 252, 253, 254, 255][:width]] * 3)
        ids = junk.clone()
        for r in range(3):
            start = len(committed[r])
            ids[r, : fed[r]] = torch.tensor(seqs[r][start : start + fed[r]])
        pos = kv.length[:, None] + torch.arange(width)
        out = t(ids, positions=pos, cache=kv, attention_mask=kv.plan(width, t.dtype), use_cache=True)
        for r in range(3):
            ref = t(torch.tensor([committed[r] + ids[r, : fed[r]].tolist()])).logits[0, -fed[r] :]
            torch.testing.assert_close(out.logits[r, : fed[r]], ref, atol=1e-4, rtol=1e-4)
            committed[r] += ids[r, : kept[r]].tolist()
        kv.commit(torch.tensor(kept))
    assert kv.length.tolist() == [len(c) for c in committed]
    both = RaggedKV.concat(
        kv.select(torch.tensor([2, 0])), RaggedKV.empty(t.model.config, 1, 2, t.dtype, "cpu")
    )
    assert both.length.tolist() == [len(committed[2]), len(committed[0]), 0]


def test_sliding_window_target():
    """Models with sliding-window layers (Gemma 3/4) get the per-layer-type mask: greedy engine output
    equals decoding with Hugging Face's own cache, and (random Gemma-3 greedy outputs soon repeat one
    token, so also at the logit level) the window is really applied."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from dspark.target import Target

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=512,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], initializer_range=0.5,
    )  # fmt: skip
    t = Target(
        Gemma3ForCausalLM(cfg), None, layer_ids=[0, 1, 2], mask_token_id=3, eos_token_ids=[], name="g3"
    )
    prompts = prompts_for(t, 3, seed=15, lo=6, hi=12)
    ref = [hf_greedy(t, p, 12) for p in prompts]
    kw = dict(temperature=0, max_new_tokens=12, concurrency=2, eos_token_ids=())
    spec = Engine(t, Oracle(t, gamma=4), seed=3, **kw).generate(prompts)
    assert [g.tokens for g in spec.generations] == ref
    assert any(r.accepted for r in spec.rounds)
    # A prompt longer than the window: the ragged cache matches a plain forward, and the same cache
    # without its window does not.
    long = prompts_for(t, 1, seed=16, lo=14, hi=15)[0]
    full = t(torch.tensor([long])).logits[0]
    for window, close in ((4, True), (None, False)):
        kv = RaggedKV.empty(t.model.config, 1, 16, t.dtype, "cpu")
        assert kv.sliding_window == 4
        kv.sliding_window = window
        pos = torch.arange(len(long))[None]
        out = t(
            torch.tensor([long]),
            positions=pos,
            cache=kv,
            attention_mask=kv.plan(len(long), t.dtype),
            use_cache=True,
        )
        assert torch.allclose(out.logits[0], full, atol=1e-4) == close


# ----------------------------------------------------------------------------------------------
# losslessness at T = 1


N_SAMPLES = 4000


@pytest.fixture(scope="module")
def stat_prompt(small_target):
    return [BOS, 57, 3, 201, 90]


def _first_three(
    target, drafter, prompt, seed, policy=None, concurrency=N_SAMPLES, cost=None, engine=Engine, **kw
):
    eng = engine(
        target,
        drafter,
        policy or (Fixed(None) if drafter is not None else None),
        temperature=1.0,
        concurrency=concurrency,
        max_new_tokens=3,
        eos_token_ids=(),
        seed=seed,
        cost=cost,
        **kw,
    )
    res = eng.generate([prompt] * N_SAMPLES)
    if policy is not None:
        eng.drafted = [s["drafted"] for s in res.steps]
        eng.last_rounds, eng.last_steps = res.rounds, res.steps
        _first_three.last = eng
    accepted = sum(r.accepted for r in res.rounds)
    return [tuple(g.tokens) for g in res.generations], accepted / max(len(res.rounds), 1)


@pytest.fixture(scope="module")
def exact(small_target, stat_prompt):
    return exact_triples(small_target, stat_prompt, N_SAMPLES)


def test_target_only_sampling_matches_exact_distribution(small_target, stat_prompt, exact):
    samples, _ = _first_three(small_target, None, stat_prompt, seed=1)
    assert_matches(samples, exact, N_SAMPLES, "target-only")


@pytest.mark.parametrize(
    "kind",
    ["dspark-markov", "dflash", "eagle3", "oracle"],
)
def test_speculative_sampling_is_lossless(small_target, stat_prompt, exact, kind):
    if kind == "oracle":
        drafter = Oracle(small_target, gamma=4)
    else:
        name, _, head = kind.partition("-")
        drafter = make_drafter(small_target, name, head or "none", gamma=4)[0]
    samples, mean_acc = _first_three(small_target, drafter, stat_prompt, seed=2)
    assert_matches(samples, exact, N_SAMPLES, kind)
    if kind == "oracle":
        assert mean_acc > 0.5, "the oracle drafter should be accepted often (else the test is weak)"


# 500 rows: verifying is flat up to 3 tokens per row and steep past it, so DraftAware drafts 2 of 4
# positions while it knows nothing, then what the observed acceptance makes pay (0: plain rounds).
DRAFT_AWARE_COST = CostModel({500: 10.0, 1500: 10.0, 2000: 100.0}, draft_ms={500: 1.0})


@pytest.mark.parametrize("kind", ["oracle", "dspark-markov"])
@pytest.mark.parametrize("policy", ["cycling", "draft_aware", "draft_aware_probing"])
def test_draft_length_chosen_before_drafting_is_lossless(small_target, stat_prompt, exact, kind, policy):
    """The draft-aware choices: how many positions to draft (fewer than γ: the drafter samples only
    those), or none (a plain decoding round), decided each round from earlier rounds' outcomes;
    probing, a plain streak ends in a draft (here after 2 plain rounds, so that probes happen).
    500 rows at a time, so eight waves of rounds meet different choices."""
    if kind == "oracle":
        drafter = Oracle(small_target, gamma=4)
    else:
        drafter = make_drafter(small_target, "dspark", "markov", gamma=4)[0]
    probing = partial(DraftAware, probe_every=2)
    pol = {"cycling": Cycling, "draft_aware": DraftAware, "draft_aware_probing": probing}[policy]()
    samples, _ = _first_three(
        small_target, drafter, stat_prompt, seed=4, policy=pol, concurrency=500, cost=DRAFT_AWARE_COST
    )
    drafted = set(_first_three.last.drafted)
    assert_matches(samples, exact, N_SAMPLES, f"{kind} / {policy} (drafted {sorted(drafted)})")
    # The choices met: plain rounds and most lengths (cycling); DraftAware's uninformed 2, then 0
    # (plain rounds) once it has seen the untrained drafter rejected.
    if policy == "cycling":
        assert 0 in drafted and len(drafted) >= 4, drafted
    else:
        assert 2 in drafted and (kind == "oracle" or 0 in drafted), drafted
    if kind != "oracle" and policy != "cycling":  # plain rounds, then drafts again only by probes
        seq = _first_three.last.drafted
        assert any(a == 0 < b for a, b in zip(seq, seq[1:])) == (policy == "draft_aware_probing"), seq


# 500 rows on a padded engine: one depth is nearly free, the next ones cost more and more, so
# HardwareAware plans 2 positions while it knows nothing and its walk stops at depth 1 or 2 by
# the round's confidences.
HARDWARE_AWARE_COST = CostModel(
    {500: 10.0, 1000: 10.5, 1500: 13.0, 2000: 20.0, 2500: 40.0}, draft_ms={500: 1.0}, padded=True
)


@pytest.mark.parametrize("policy", ["hardware_aware", "hardware_aware_clocked", "threshold"])
def test_confidence_lengths_after_a_planned_draft_are_lossless(small_target, stat_prompt, exact, policy):
    """The confidence-driven choices after a draft length planned from earlier rounds:
    HardwareAware's pre-draft plan then its depth walk over the round's confidences (the width
    read back); the same with the clock choosing between walked and whole-draft rounds from the
    times of completed ones (every other round runs the other way); the threshold's bound from
    its recent lengths then its prefix cut."""
    drafter = make_drafter(small_target, "dspark", "markov", gamma=4)[0]
    pol = {
        "hardware_aware": HardwareAware(),
        "hardware_aware_clocked": HardwareAware(explore_every=2, min_timed=1),
        "threshold": Threshold(0.3),
    }[policy]
    samples, _ = _first_three(
        small_target, drafter, stat_prompt, seed=6, policy=pol, concurrency=500, cost=HARDWARE_AWARE_COST
    )
    eng = _first_three.last
    proposed = {r.proposed for r in eng.last_rounds}
    assert_matches(samples, exact, N_SAMPLES, f"{policy} (drafted {sorted(set(eng.drafted))})")
    assert len(proposed) > 1, proposed  # lengths were cut by the confidences
    read_back = {s["readback_ms"] > 0 for s in eng.last_steps if s["drafted"]}
    if policy == "hardware_aware":
        assert read_back == {True}
    if policy == "hardware_aware_clocked":  # walked and whole-draft rounds both ran
        assert read_back == {True, False} and pol._clock


def test_shadow_walks_are_lossless_and_read_nothing_back(small_target, stat_prompt, exact):
    """HardwareAware that believes walking never pays, exploring every round: each round verifies
    its whole draft without a read-back, the round's confidences reach the policy with the outcome
    and it walks them on the host (here the walks cut, so the estimate rises and real walks
    resume); the output stays the target's distribution."""
    drafter = make_drafter(small_target, "dspark", "markov", gamma=4)[0]
    pol = HardwareAware(explore_every=1)
    pol._realised = 0.0
    seen = []
    observe = pol.observe_shadow
    pol.observe_shadow = lambda conf: seen.append(conf.copy()) or observe(conf)
    cost = CostModel(HARDWARE_AWARE_COST.verify_ms, draft_ms={500: 1.0}, padded=True, readback_ms=0.9)
    samples, _ = _first_three(
        small_target, drafter, stat_prompt, seed=8, policy=pol, concurrency=500, cost=cost
    )
    eng = _first_three.last
    assert_matches(samples, exact, N_SAMPLES, "hardware_aware, shadow walks")
    drafting = [s for s in eng.last_steps if s["drafted"]]
    assert seen and all(c.shape == (s["batch"], s["drafted"]) for c, s in zip(seen, drafting))
    walked = [int(pol._walk_lengths(torch.from_numpy(c), cost).max()) for c in seen]
    assert drafting[0]["readback_ms"] == 0 and min(walked) < 2  # shadows that cut
    assert pol._realised > 0


def test_deferred_drafter_context_is_lossless(small_target, stat_prompt, exact):
    """The fast engine's plain rounds (target-only step, the drafter's context written later in
    one batch before the next draft): Cycling starts with a plain round, so every draft of the
    second round reads context the ring wrote."""
    from dspark.decoding.fast_engine import FastEngine

    drafter = make_drafter(small_target, "dspark", "markov", gamma=4)[0]
    samples, _ = _first_three(
        small_target, drafter, stat_prompt, seed=7, policy=Cycling(), concurrency=500, engine=FastEngine,
        buckets=(512,), deferred_context=2,
    )  # fmt: skip
    drafted = _first_three.last.drafted
    assert drafted[0] == 0 and any(drafted[1:]), drafted
    assert_matches(samples, exact, N_SAMPLES, f"fast engine / cycling (drafted {sorted(set(drafted))})")


def test_broken_verification_is_caught(small_target, stat_prompt, exact, monkeypatch):
    """Negative control: accepting every draft makes the output the drafter's distribution."""

    def accept_all(target_probs, draft_probs, tokens, lengths, **kw):
        r, g = tokens.shape
        bonus = target_probs[torch.arange(r), lengths]
        nxt = sample_from(bonus, torch.rand(r))
        return VerifyResult(
            accepted=lengths.clone(), next_token=nxt, accept_flags=torch.arange(g)[None] < lengths[:, None]
        )

    monkeypatch.setattr(engine_mod, "verify", accept_all)
    samples, _ = _first_three(small_target, Oracle(small_target, gamma=4), stat_prompt, seed=3)
    counts = Counter(samples)
    obs = [counts.get(k, 0) for k in exact] + [N_SAMPLES - sum(counts.get(k, 0) for k in exact)]
    exp = [p * N_SAMPLES for p in exact.values()] + [(1 - sum(exact.values())) * N_SAMPLES]
    assert chi2_pvalue(obs, exp) < 1e-6


# ----------------------------------------------------------------------------------------------
# greedy parity


def test_greedy_parity_smollm2_every_drafter(smollm2_target):
    """Speculative greedy output equals target-only greedy output token for token (SmolLM2, float32)."""
    t = smollm2_target
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
    ]
    prompts = [t.chat_ids([{"role": "user", "content": q}]) for q in questions]
    n = 24
    base = Engine(t, None, temperature=0, max_new_tokens=n, concurrency=3, eos_token_ids=()).generate(prompts)
    assert base.generations[0].tokens == hf_greedy(t, prompts[0], n)
    for kind in ("dspark-markov", "dspark-rnn", "dflash", "eagle3"):
        name, _, head = kind.partition("-")
        drafter = make_drafter(t, name, head or "none", gamma=3)[0]
        res = Engine(t, drafter, temperature=0, max_new_tokens=n, concurrency=3, eos_token_ids=()).generate(
            prompts
        )
        for g, ref in zip(res.generations, base.generations):
            assert g.tokens == ref.tokens, f"{kind}: greedy output differs from target-only decoding"


@pytest.mark.parametrize("kind", ["oracle", "dspark-markov", "eagle3"])
def test_greedy_parity_with_partial_acceptance(small_target, kind):
    """Many partially accepted blocks, ragged lengths, prompts of different lengths."""
    t = small_target
    prompts = prompts_for(t, 5, seed=4)
    n = 40
    base = Engine(t, None, temperature=0, max_new_tokens=n, concurrency=5, eos_token_ids=()).generate(prompts)
    assert base.generations[1].tokens == hf_greedy(t, prompts[1], n)
    if kind == "oracle":
        drafter = Oracle(t, gamma=5)
    else:
        name, _, head = kind.partition("-")
        drafter = make_drafter(t, name, head or "none", gamma=5)[0]
    res = Engine(
        t, drafter, temperature=0, max_new_tokens=n, concurrency=5, eos_token_ids=(), seed=1
    ).generate(prompts)
    for g, ref in zip(res.generations, base.generations):
        assert g.tokens == ref.tokens
    if kind == "oracle":
        accepted = Counter(r.accepted for r in res.rounds)
        assert accepted[0] and accepted[5] and sum(accepted[k] for k in range(1, 5)), accepted


# ----------------------------------------------------------------------------------------------
# bookkeeping and continuous batching


def test_bookkeeping_sums(small_target):
    t = small_target
    prompts = prompts_for(t, 6, seed=5)
    budgets = [1, 7, 13, 20, 26, 33]
    reqs = [Request(prompt=p, max_new_tokens=b, id=f"r{i}") for i, (p, b) in enumerate(zip(prompts, budgets))]
    res = Engine(t, Oracle(t, gamma=4), temperature=1.0, concurrency=3, eos_token_ids=(), seed=6).generate(
        reqs
    )
    for req, gen in zip(reqs, res.generations):
        assert gen.id == req.id and gen.finish == "length" and len(gen.tokens) == req.max_new_tokens
        mine = [r for r in res.rounds if r.request == req.id]
        assert [r.round for r in mine] == list(range(len(mine))) and gen.rounds == len(mine)
        # The prefill samples the first token; every round then emits accepted + 1 ...
        assert 1 + sum(r.emitted for r in mine) == len(gen.tokens)
        assert all(r.emitted == r.accepted + 1 for r in mine[:-1])
        # ... except that the budget may cut the last round short.
        if mine:
            assert 1 <= mine[-1].emitted <= mine[-1].accepted + 1
            assert sum(r.accepted + 1 for r in mine) >= len(gen.tokens) - 1
        for r in mine:
            assert r.accept_flags == [True] * r.accepted + [False] * (r.proposed - r.accepted)
    # Σ emitted (= Σ(accepted + 1) where no budget cut) + one prefill token per request.
    assert res.new_tokens == sum(1 for b in budgets if b > 0) + sum(r.emitted for r in res.rounds)
    uncut = [
        g
        for g in res.generations
        if g.rounds
        and (last := [r for r in res.rounds if r.request == g.id][-1])
        and last.emitted == last.accepted + 1
    ]
    for g in uncut:
        assert 1 + sum(r.accepted + 1 for r in res.rounds if r.request == g.id) == len(g.tokens)
    assert max(r.batch for r in res.rounds) == 3


@pytest.mark.parametrize("kind", ["oracle", "dspark-markov"])
def test_batched_equals_one_by_one_and_continuous_batching(small_target, kind):
    t = small_target
    prompts = prompts_for(t, 7, seed=9)
    budgets = [5, 30, 12, 22, 9, 17, 26]
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
    drafter = Oracle(t, gamma=4) if kind == "oracle" else make_drafter(t, "dspark", "markov", gamma=4)[0]
    batched = Engine(t, drafter, temperature=0, concurrency=3, eos_token_ids=(), seed=10).generate(reqs)
    assert max(s["batch"] for s in batched.steps) == 3  # 7 prompts through 3 slots
    single = [
        Engine(t, drafter, temperature=0, concurrency=1, eos_token_ids=(), seed=11)
        .generate([r])
        .generations[0]
        for r in reqs
    ]
    target_only = Engine(t, None, temperature=0, concurrency=4, eos_token_ids=()).generate(reqs)
    for b, s, ref, budget in zip(batched.generations, single, target_only.generations, budgets):
        assert b.tokens == s.tokens == ref.tokens and len(b.tokens) == budget


def test_the_prefills_token_is_read_with_the_next_round(small_target, monkeypatch):
    """A prefill reads nothing back: each request's first token is emitted when the first round
    after its prefill completes, before that round's own tokens. Budgets of 0, 1 and 2 and a first
    token that is EOS end as if it were read at once (a row that ended on it rides along in that
    round, its tokens void), with a queue refilling the rows, with and without a drafter. The fast
    engine's prefill reads no tensor back (each read would wait for the device on CUDA; the plain
    engine's growing cache plans its masks on the host)."""
    t = small_target
    prompts = prompts_for(t, 5, seed=21)
    free = Engine(t, None, temperature=0, max_new_tokens=6, eos_token_ids=()).generate(prompts)
    eos = free.generations[2].tokens[0]  # request 2 ends on its first token
    budgets = [0, 1, 6, 2, 6]
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
    dspark = make_drafter(t, "dspark", "markov", gamma=3, seed=1)[0]
    for kind, drafter in [("plain", None), ("plain", Oracle(t, gamma=3)), ("fast", None), ("fast", dspark)]:
        eng = build_engine(kind, t, drafter, temperature=0, concurrency=2, eos_token_ids=[eos], seed=1)

        def reads_nothing_back(*args, prefill=eng._prefill):
            with monkeypatch.context() as m:
                for name in ("tolist", "item", "__int__", "__float__"):
                    m.setattr(torch.Tensor, name, lambda *a: pytest.fail("the prefill read a tensor back"))
                return prefill(*args)

        if kind == "fast":
            eng._prefill = reads_nothing_back
        res = eng.generate(reqs)
        for g, ref, budget in zip(res.generations, free.generations, budgets):
            want = ref.tokens[:budget]
            want = want[: want.index(eos) + 1] if eos in want else want
            assert g.tokens == want
            assert g.finish == ("eos" if eos in want else "length")
        assert res.generations[2].tokens == [eos] and res.generations[2].rounds == 0
        assert sum(r.emitted for r in res.rounds) == res.new_tokens - 4  # four prefills' first tokens


@pytest.mark.parametrize("kind", ["plain", "fast"])
def test_two_rounds_ahead_give_the_same_tokens(small_target, kind):
    """``pipeline=2``: round t goes onto the device before round t - 2 is read (three rounds are
    launched before the first read); finished requests ride along one round more, their tokens
    dropped. Greedy tokens and finishes are those of ``pipeline=1``, with budgets from 0 to 26, an
    EOS, and a queue that refills the rows, target-only and with a drafter."""
    t = small_target
    prompts = prompts_for(t, 7, seed=9)
    free = Engine(t, None, temperature=0, max_new_tokens=26, eos_token_ids=()).generate(prompts)
    eos = free.generations[3].tokens[4]  # request 3 ends on its fifth token
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [5, 26, 0, 22, 1, 17, 2])]
    dspark = make_drafter(t, "dspark", "markov", gamma=3, seed=1)[0]

    def spied(eng, name, events):
        inner = getattr(eng, name)

        def call(*args):
            events.append(name)
            return inner(*args)

        setattr(eng, name, call)

    for drafter in (None, dspark):
        results, events = {}, []
        for pipeline in (1, 2):
            eng = build_engine(
                kind, t, drafter, temperature=0, concurrency=3, eos_token_ids=[eos], seed=1, pipeline=pipeline
            )
            if pipeline == 2:
                spied(eng, "_launch", events)
                spied(eng, "_complete", events)
            results[pipeline] = eng.generate(reqs)
        one, two = ([(g.tokens, g.finish) for g in results[p].generations] for p in (1, 2))
        assert two == one
        assert events[:4] == ["_launch", "_launch", "_launch", "_complete"]
        assert events.count("_launch") == events.count("_complete") == len(results[2].steps)
        assert "eos" in {finish for _, finish in one}
    with pytest.raises(ValueError, match="pipeline"):
        Engine(t, None, pipeline=3)


def test_two_rounds_ahead_are_lossless(small_target, stat_prompt, exact):
    """Planned two rounds ahead (``pipeline=2``), DraftAware chooses each round's draft length from
    outcomes one round older: still before the draft exists, so the tokens keep the target's
    distribution. 500 rows at a time, as the one-round-ahead test."""
    drafter = Oracle(small_target, gamma=4)
    pol, cost = DraftAware(), DRAFT_AWARE_COST
    samples, _ = _first_three(
        small_target, drafter, stat_prompt, seed=5, policy=pol, concurrency=500, cost=cost, pipeline=2
    )
    drafted = set(_first_three.last.drafted)
    assert_matches(samples, exact, N_SAMPLES, f"pipeline 2 / draft_aware (drafted {sorted(drafted)})")
    assert 2 in drafted, drafted


@pytest.mark.parametrize("kind", ["plain", "fast"])
def test_requests_join_behind_the_round_in_flight(small_target, kind):
    """A request that takes a freed row is prefilled while the round launched before is still in
    flight (its outcome not read): the host goes on to launch the next round without waiting for
    the device. The tokens are target-only's, greedy and with a queue that refills rows often."""
    t = small_target
    drafter = make_drafter(t, "dspark", "markov", gamma=3, seed=2)[0]
    eng = build_engine(kind, t, drafter, temperature=0, concurrency=2, eos_token_ids=(), seed=0)
    events = []

    def spy(name):
        inner = getattr(eng, name)

        def call(*args):
            events.append(name)
            return inner(*args)

        return call

    for name in ("_prefill", "_launch", "_complete"):
        setattr(eng, name, spy(name))
    budgets = [3, 9, 4, 7, 5, 2]
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts_for(t, 6, seed=3), budgets)]
    res = eng.generate(reqs)
    in_flight, behind = 0, 0
    for e in events:
        in_flight += {"_launch": 1, "_complete": -1}.get(e, 0)
        behind += e == "_prefill" and in_flight > 0
    assert behind >= 2 and events.count("_prefill") > behind  # every join but the first batch's
    base = Engine(t, None, temperature=0, concurrency=1, eos_token_ids=()).generate(reqs)
    assert [g.tokens for g in res.generations] == [g.tokens for g in base.generations]


@pytest.mark.parametrize("kind", ["oracle", "target_only", "target_only_fast"])
def test_eos_stops_requests(small_target, kind):
    """A request ends at its first EOS (kept) or at its budget, in drafting rounds (the oracle's)
    and in rounds that draft nothing (target-only decoding's lean completion), on both engines."""
    t = small_target
    prompts = prompts_for(t, 4, seed=12)
    budgets = [30, 30, 11, 30]
    free = Engine(t, None, temperature=0, max_new_tokens=30, eos_token_ids=()).generate(prompts)
    eos = free.generations[0].tokens[6]
    drafter = Oracle(t, gamma=4) if kind == "oracle" else None
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
    res = build_engine(
        "fast" if kind.endswith("fast") else "plain", t, drafter, temperature=0, concurrency=2,
        eos_token_ids=[eos], seed=13,
    ).generate(reqs)  # fmt: skip
    for g, ref, budget in zip(res.generations, free.generations, budgets):
        cut = ref.tokens.index(eos) + 1 if eos in ref.tokens[:budget] else budget
        assert g.tokens == ref.tokens[:cut]
        assert g.finish == ("eos" if eos in ref.tokens[:budget] else "length")
    assert res.generations[0].finish == "eos" and len(res.generations[0].tokens) <= 7
    assert {g.finish for g in res.generations} == {"eos", "length"}


def test_refill_streaming_and_no_round_records(small_target):
    """Finished rows idle until ``refill`` of them leave together (with a drafter, whose context
    must not grow for idle rows): greedy tokens are those of immediate retirement, results stream
    through on_result in completion order, and record_rounds=False only drops the records."""
    t = small_target
    prompts = prompts_for(t, 9, seed=18)
    budgets = [3, 17, 8, 25, 5, 12, 30, 2, 9]
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, budgets)]
    base = Engine(t, None, temperature=0, concurrency=4, eos_token_ids=()).generate(reqs)
    order = []
    lazy = Engine(
        t, Oracle(t, gamma=3), temperature=0, concurrency=4, eos_token_ids=(), seed=4, refill=3,
        record_rounds=False,
    ).generate(reqs, on_result=lambda i, g: order.append(i))  # fmt: skip
    assert [g.tokens for g in lazy.generations] == [g.tokens for g in base.generations]
    assert sorted(order) == list(range(9)) and order != list(range(9))
    assert lazy.rounds == [] and sum(g.accepted for g in lazy.generations) > 0
    # Rows idled: some rounds decoded fewer live requests than rows while the queue was not empty.
    assert min(s["batch"] for s in lazy.steps[:10]) < 4


def test_round_records_are_built_after_the_last_round(small_target, monkeypatch):
    """A round keeps only what its records need (``_RoundRows``); the per-row ``RoundRecord``s are
    built after the last round, off the rounds' clock, and say what the rounds did: one per live
    row and round, in round order, their tokens the generations' tokens after each prefill's first."""
    from dspark.decoding.engine import _RoundRows

    t = small_target
    drafter = make_drafter(t, "dspark", "markov", gamma=3)[0]  # with confidences
    eng = Engine(t, drafter, temperature=1.0, concurrency=2, eos_token_ids=(), seed=2)
    events, loop, build = [], eng._rounds_loop, _RoundRows.records
    eng._rounds_loop = lambda *args: (loop(*args), events.append("last round"))
    monkeypatch.setattr(_RoundRows, "records", lambda rows: events.append("records") or build(rows))
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts_for(t, 3, seed=5), [6, 11, 4])]
    res = eng.generate(reqs)
    assert events[0] == "last round" and events.count("records") == len(res.steps)
    assert len(res.rounds) == sum(s["batch"] for s in res.steps)
    assert [r.step for r in res.rounds] == sorted(r.step for r in res.rounds)
    assert sum(r.emitted for r in res.rounds) == res.new_tokens - 3 == 6 + 11 + 4 - 3  # prefill's first
    for r in res.rounds:
        assert r.drafted == 3 and r.accept_flags == [True] * r.accepted + [False] * (r.proposed - r.accepted)
        assert len(r.confidence_logits) == len(r.confidence) == 3
    # record_confidence=False (e2e's timed runs): the same rounds and tokens, no confidences read back
    lean = Engine(
        t, drafter, temperature=1.0, concurrency=2, eos_token_ids=(), seed=2, record_confidence=False
    ).generate(reqs)
    assert [g.tokens for g in lean.generations] == [g.tokens for g in res.generations]
    assert [(r.accepted, r.proposed) for r in lean.rounds] == [(r.accepted, r.proposed) for r in res.rounds]
    assert all(r.confidence_logits is None and r.confidence is None for r in lean.rounds)


def test_retire_order_moves_only_the_rows_that_must():
    """Rows below the new batch size keep their place; each finished one takes the next running
    row from above (a 256-row cache losing one request moves one row, not all of them)."""
    assert retire_order([True, True, True]) == [0, 1, 2]
    assert retire_order([True, True, False]) == [0, 1]
    assert retire_order([True, False, True, True]) == [0, 3, 2]
    assert retire_order([False, True, False, True, True, False]) == [3, 1, 4]
    assert retire_order([False, False]) == []
    running = [i % 5 != 2 for i in range(256)]
    order = retire_order(running)
    assert sorted(order) == [i for i in range(256) if running[i]]
    assert sum(new != old for new, old in enumerate(order)) == running[: len(order)].count(False)


def test_generate_freezes_the_heap_and_reports_host_time(small_target):
    """While rounds run, the objects alive before ``generate`` are out of the cyclic collector's
    reach (a full collection over a large heap stalled rounds); afterwards they are back. Each
    round reports the host's own work and its waits apart, and a read-back only under a policy
    whose width depends on the confidences. The launch's parts add up to the launch, without the
    read-back; a round that drafts nothing has no draft step."""
    import gc

    t = small_target
    drafter = make_drafter(t, "dspark", "markov", gamma=3, seed=1)[0]
    frozen = []
    assert gc.get_freeze_count() == 0
    for pol, reads_back in ((Fixed(None), False), (ReadsBack(), True), (Cycling(), False)):
        eng = Engine(t, drafter, pol, temperature=0, concurrency=2, max_new_tokens=6, eos_token_ids=())
        res = eng.generate(
            prompts_for(t, 3, seed=2), on_result=lambda i, g: frozen.append(gc.get_freeze_count())
        )
        assert gc.get_freeze_count() == 0 and min(frozen) > 0
        for s in res.steps:
            assert s["host_ms"] > 0 and s["wait_ms"] >= 0 and s["ms"] >= s["host_ms"]
            assert (s["readback_ms"] > 0) == reads_back
            parts = s["launch_parts"]
            assert list(parts) == list(LAUNCH_PARTS) and min(parts.values()) >= 0
            assert sum(parts.values()) == pytest.approx(s["launch_ms"], rel=1e-9)
            assert (parts["draft"] > 0) == (s["drafted"] > 0) and parts["target"] > 0
        assert {s["drafted"] > 0 for s in res.steps} == (
            {True, False} if isinstance(pol, Cycling) else {True}
        )
    gc.freeze()  # a caller that froze its heap keeps it frozen
    try:
        Engine(t, None, temperature=0, max_new_tokens=3).generate(prompts_for(t, 1, seed=3))
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_joining_requests_are_timed_between_rounds(small_target, monkeypatch):
    """Each round after the first reports the host's cycle (from the previous round's completion to
    its own) and, of it, the work between rounds: a joining request's prefill lands there, in the
    cycle it ran in, and in no round's own host work."""
    import time

    t = small_target
    eng = Engine(t, None, temperature=0, concurrency=2, eos_token_ids=())
    prefill, joins = eng._prefill, []

    def slow_prefill(*args, **kwargs):
        joins.append(len(joins))
        time.sleep(0.05)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(eng, "_prefill", slow_prefill)
    budgets = [2, 12, 4, 9, 3]  # rows free up one at a time: three joins of one request each
    reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts_for(t, 5, seed=2), budgets)]
    res = eng.generate(reqs)
    first, *rest = res.steps
    assert "cycle_ms" not in first  # its cycle would hold the first prefill
    for s in rest:
        assert s["cycle_ms"] >= s["between_ms"] + s["wait_ms"] and s["between_ms"] >= 0
    assert len(joins) == 4  # the first two requests' prefill, then the three joins
    assert sum(s["between_ms"] >= 50 for s in rest) == len(joins) - 1
    assert all(s["host_ms"] < 50 for s in res.steps)


def test_rounds_with_one_off_work_are_not_timed_for_the_policy(small_target, monkeypatch):
    """A round whose record names one-off work (``events``: a graph capture, a compile, a GC pass)
    is kept in the steps but not handed to the policy's clock; every other round is, in order."""
    from itertools import count

    from dspark.decoding.stall_watch import StallWatch

    t = small_target
    drafter = make_drafter(t, "dspark", "markov", gamma=3, seed=1)[0]
    calls = count()  # every third round met a GC pass
    stalled = lambda self: {"gc_passes": 1} if next(calls) % 3 == 1 else {}  # noqa: E731
    monkeypatch.setattr(StallWatch, "increments", stalled)
    timed = []
    pol = Fixed(None)
    pol.observe_time = timed.append
    res = Engine(t, drafter, pol, temperature=0, concurrency=2, max_new_tokens=8, eos_token_ids=()).generate(
        prompts_for(t, 3, seed=2)
    )
    clean = [s["ms"] for s in res.steps if not s["events"]]
    assert len(clean) < len(res.steps) and timed == clean


class ReadsBack(Fixed):
    """The whole block, with a width the engine reads back (a confidence-driven policy's path)."""

    def width(self, drafted):
        return None


# ----------------------------------------------------------------------------------------------
# confidences, calibration, policies


def test_engine_asks_the_policy_what_it_needs(small_target):
    """Capabilities, not names: a wrapped policy is refused for what it wraps."""
    dflash, _, _ = make_drafter(small_target, "dflash")
    with pytest.raises(ValueError, match=r"'threshold\[:2\]' needs per-position confidences"):
        Engine(small_target, dflash, build_policy("threshold", gamma=2, block=4))
    dspark, _, _ = make_drafter(small_target, "dspark", "markov")
    with pytest.raises(ValueError, match="needs a cost model"):
        Engine(small_target, dspark, build_policy("hardware_aware", gamma=2, block=4))
    cost = CostModel.analytical()
    assert Engine(small_target, dspark, build_policy("hardware_aware", gamma=2, block=4), cost=cost)


@pytest.mark.parametrize("offsets", [None, [-0.5, 0.3, 1.0, -1.2]], ids=["sts", "sts_offsets"])
def test_engine_applies_calibration_temperatures(small_target, tmp_path, offsets):
    t = small_target
    drafter, dc, hc = make_drafter(t, "dspark", "markov", gamma=4, seed=3)
    save_drafter(drafter, tmp_path, dc, hc, t.describe())
    temps = [0.5, 2.0, 3.0, 0.25]
    DrafterFolder(tmp_path).write_calibration(Calibration(temps, offsets))
    b = torch.tensor(offsets or [0.0] * 4)
    prompts = prompts_for(t, 3, seed=14)
    eng = Engine.from_checkpoint(
        t, tmp_path, Threshold(0.3), temperature=1.0, max_new_tokens=12, eos_token_ids=()
    )
    res = eng.generate(prompts)
    expect = []
    for r in res.rounds:  # the threshold drafts the first k <= 4 positions, calibrated by T_1..T_k
        z, c = torch.tensor(r.confidence_logits), torch.tensor(r.confidence)
        torch.testing.assert_close(c, torch.sigmoid(z / torch.tensor(temps[: len(z)]) + b[: len(z)]))
        # The policy saw the calibrated values: ℓ = leading run of Π c_i >= 0.3.
        expect.append(int(torch.cumprod((torch.cumprod(c.double(), 0) >= 0.3).long(), 0).sum()))
    assert [r.proposed for r in res.rounds] == expect
    assert len(set(expect)) > 1, "pick a threshold that makes lengths vary"
    # Without the file the raw sigmoid is used.
    (tmp_path / "calibration.json").unlink()
    raw = Engine.from_checkpoint(t, tmp_path, Fixed(None), max_new_tokens=4, eos_token_ids=()).generate(
        prompts
    )
    r0 = raw.rounds[0]
    torch.testing.assert_close(torch.tensor(r0.confidence), torch.sigmoid(torch.tensor(r0.confidence_logits)))


def test_policy_needing_confidences_rejects_dflash(small_target):
    drafter = make_drafter(small_target, "dflash", gamma=3)[0]
    with pytest.raises(ValueError, match="confidence head"):
        Engine(small_target, drafter, Threshold(0.5))
    with pytest.raises(ValueError, match="calibration has 2 temperatures"):
        Engine(
            small_target, make_drafter(small_target, "dspark", "markov", gamma=3)[0], calibration=[1.0, 1.0]
        )


def test_round_statistics():
    rows = [
        {"accepted": 2, "proposed": 4, "confidence_logits": [0.0] * 4, "confidence": [0.9, 0.8, 0.5, 0.1]},
        {"accepted": 0, "proposed": 4, "confidence_logits": [0.0] * 4, "confidence": [0.4, 0.9, 0.9, 0.9]},
        {
            "accepted": 4,
            "proposed": 4,
            "confidence_logits": [0.0] * 4,
            "confidence": [0.95, 0.95, 0.95, 0.95],
        },
    ]
    assert conditional_acceptance(rows, 4) == [2 / 3, 1.0, 0.5, 1.0]
    # A round that drafted fewer positions (draft_aware) or none carries no whole block: left out.
    short = {"accepted": 1, "proposed": 2, "confidence_logits": [0.0] * 2, "confidence": [0.9, 0.9]}
    plain = {"accepted": 0, "proposed": 0, "confidence_logits": None, "confidence": None}
    assert calibration_arrays(rows + [short, plain])[0].shape == (3, 4)
    assert threshold_sweep(rows + [short, plain], [0.5])[0]["rounds"] == 3
    z, y, valid = calibration_arrays(rows)
    assert y.tolist()[0] == [1, 1, 0, 0] and bool(valid.all())
    sweep = {r["threshold"]: r for r in threshold_sweep(rows, [0.0, 0.5])}
    assert sweep[0.0]["tokens_per_step"] == 4 and sweep[0.0]["acceptance_rate"] == 6 / 12
    # t = 0.5: prefixes [0.9, 0.72] -> 2, [0.4] -> 0, [0.95, .9025, .857, .8145] -> 4
    assert sweep[0.5]["tokens_per_step"] == 2 and sweep[0.5]["acceptance_rate"] == 1.0
    assert math.isclose(sweep[0.5]["tau"], (3 + 1 + 5) / 3)


def test_a_proposal_without_draft_probabilities_is_verified_only_when_greedy(small_target):
    """Greedy proposals may omit their distributions (one-hot rows stand in); at T > 0 drafted
    tokens without them cannot be verified losslessly and are refused; a round that drafted
    nothing has none at any temperature."""
    drafts, nothing = torch.tensor([[3, 1], [0, 2]]), torch.zeros(2, 0, dtype=torch.long)
    greedy = Engine(small_target, None, temperature=0.0)._one_hot_drafts(drafts, 5)
    assert torch.equal(greedy.argmax(-1), drafts) and torch.equal(greedy.sum(-1), torch.ones(2, 2))
    sampled = Engine(small_target, None, temperature=1.0)
    assert sampled._one_hot_drafts(nothing, 5).shape == (2, 0, 5)
    with pytest.raises(RuntimeError, match="only greedy"):
        sampled._one_hot_drafts(drafts, 5)
