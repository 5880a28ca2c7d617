"""Training and inference compute the same draft distributions.

For every drafter variant, a real engine (plain; fast, over its static cache; fast through the
fused inference paths of ``compile_inference``, eagerly) decodes a few prompts greedily, and every
``propose`` it makes is captured with the drafter state it was given: the context the engine built
for the prefix ending at the anchor (prefill, verification steps, deferred plain rounds, rows
moved by continuous batching). Then, on the finished sequences, ``train_forward`` runs as the
training step runs it (taps from the module's feature source, the same anchors) and, for each
captured call, the drafter's teacher-forced logits for anchor a must equal what ``propose``
computes from the engine's state with the draft tokens forced to the true tokens x_{a+1}.. (its
uniforms steered draw by draw): the logits (to float32 rounding), the confidence logits, the
labels, and the engine's own greedy drafts (the argmax) wherever its earlier drafts were the true
tokens. The training loss's target row a+k-1 of draft k is the one whose greedy token the engine
emitted as x_{a+k}.

Without this, a one-position shift in what one side sees (which taps form the context, the block's
rotary positions, the anchor slot's token, the slot convention, the head's previous token) leaves
every other test green and only lowers acceptance: the two controls at the end show the comparison
catches such shifts."""

from __future__ import annotations

import pytest
import torch
from conftest import head_group, load_group
from test_engine import Cycling, prompts_for

from dspark.core.types import DraftCache, Shared, TargetDims
from dspark.decoding.engine import Engine, Request
from dspark.decoding.fast_engine import FastEngine
from dspark.drafters import build_drafter
from dspark.module import online_features

GAMMA = 4  # block_size
FORCE_T = 4.0  # the temperature of the forced proposals: every token keeps a drawable probability

BLOCK_VARIANTS = [
    ("dflash", "none", "anchor"),
    ("dflash", "none", "masks"),
    ("dspark", "markov", "anchor"),
    ("dspark", "gated", "anchor"),
    ("dspark", "rnn", "anchor"),
    ("dspark", "markov", "masks"),
    ("dspark", "gated", "masks"),
    ("dspark", "rnn", "masks"),
    ("dspark", "gated@2", "anchor"),  # the head from position 2 (head.first_position)
]


def build(target, name, head, slots="anchor", layers=2, seed=0):
    """A drafter whose every part moves its outputs: norms off one, layers that change the hidden
    states well beyond the block's embeddings, a sequential head with a real bias."""
    dc, hc = load_group("drafter", name), head_group(head)
    dc.num_layers, dc.block_size = layers, GAMMA
    if name == "eagle3":
        dc.ttt_steps = GAMMA
    else:
        dc.slots = slots
    hc.rank = 16 if head != "none" else 0
    torch.manual_seed(seed)
    drafter = build_drafter(TargetDims.of(target), dc, hc).eval()
    with torch.no_grad():
        for module in drafter.modules():
            if type(module).__name__ == "RMSNorm":
                module.weight.normal_(1.0, 0.3)
            elif isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, 0.15)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.3)
        if getattr(drafter, "head", None) is not None:
            drafter.head.W1.weight.normal_(0.0, 0.5)
            drafter.head.W2.weight.normal_(0.0, 0.5)
    return drafter


def snapshot(cache: DraftCache) -> DraftCache:
    return DraftCache(
        k=[k.clone() for k in cache.k],
        v=[v.clone() for v in cache.v],
        length=cache.length.clone(),
        extra={key: val.clone() for key, val in cache.extra.items()},
        block_slots=cache.block_slots,
    )


def decode_and_capture(engine, drafter, requests, monkeypatch):
    """Run ``engine`` over ``requests``; return each request's whole sequence (prompt + output) and
    every ``propose`` call: the drafter state it got, its anchors and positions, the request of
    each row and the tokens it proposed."""
    calls, rows = [], {}
    launch, propose = engine._launch, drafter.propose

    def spy_launch(live, anchors, anchor_pos, step):
        rows["ids"] = [item.req.id for item in live]
        return launch(live, anchors, anchor_pos, step)

    def spy_propose(cache, anchor_tokens, anchor_pos, *args, **kw):
        prop = propose(cache, anchor_tokens, anchor_pos, *args, **kw)
        calls.append(
            dict(
                cache=snapshot(cache),
                anchors=anchor_tokens.clone(),
                pos=anchor_pos.clone(),
                ids=list(rows["ids"]),
                tokens=prop.tokens.clone(),
            )
        )
        return prop

    with monkeypatch.context() as spies:
        spies.setattr(engine, "_launch", spy_launch)
        spies.setattr(drafter, "propose", spy_propose)
        res = engine.generate(requests)
    seqs = {r.id: list(r.prompt) + g.tokens for r, g in zip(requests, res.generations)}
    return seqs, calls


@torch.inference_mode()
def forced_proposal(drafter, cache, anchors, anchor_pos, truth, known, shared):
    """``propose`` at FORCE_T with draft k steered to ``truth[:, k-1]`` where ``known`` (a prefix of
    each row): each draw's uniform is set inside the forced token's slice of the inverse CDF of the
    distribution ``propose`` itself returns for that position."""
    r, gamma = truth.shape
    u = torch.full((r, gamma), 0.5)
    for k in range(gamma + 1):
        prop = drafter.propose(cache, anchors, anchor_pos, shared, FORCE_T, uniforms=u)
        if k == gamma:
            break
        p = prop.probs[:, k].double()
        tok = truth[:, k : k + 1]
        below = p.cumsum(-1).gather(1, tok) - p.gather(1, tok)
        steered = ((below + 0.5 * p.gather(1, tok)) / p.sum(-1, keepdim=True))[:, 0].float()
        u[:, k] = torch.where(known[:, k], steered, u[:, k])
    assert torch.equal(prop.tokens[known], truth[known]), "the forced draws did not land"
    return prop


def train_outputs(drafter, target, seq: list[int], anchors: list[int], shared):
    """``train_forward`` over one sequence with the training step's features and the given anchors:
    draft logits [A, γ, V] (for Eagle3, [T, γ, V]: every position is an anchor), confidence logits,
    labels, validity, target positions, and the target's final hidden states [T, d]."""
    ids = torch.tensor([seq])
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        taps, last_hidden = online_features({"input_ids": ids}, target)
        out = drafter.train_forward(taps, ids, loss_mask, torch.tensor([sorted(anchors)]), shared)
        logits = out.logits(shared.lm_weight).float()
    conf = None if out.confidence_logits is None else out.confidence_logits[0]
    return logits[0], conf, out.labels[0], out.valid[0], out.target_positions[0], last_hidden[0]


def check_consistency(drafter, target, seqs, calls, shared) -> dict:
    """Every captured call against ``train_forward``; returns how many positions were compared."""
    eagle = drafter.kind == "eagle3"
    gamma = drafter.gamma
    anchors_of: dict = {}
    for call in calls:
        for i, rid in enumerate(call["ids"]):
            a = int(call["pos"][i])
            if a < len(seqs[rid]):  # else a row riding along after its request ended
                anchors_of.setdefault(rid, set()).add(a)
    train = {rid: train_outputs(drafter, target, seqs[rid], list(a), shared) for rid, a in anchors_of.items()}
    counted = {"rows": 0, "positions": 0, "deep": 0, "greedy": 0}
    for call in calls:
        r = len(call["ids"])
        truth = torch.zeros(r, gamma, dtype=torch.long)
        known = torch.zeros(r, gamma, dtype=torch.bool)
        for i, rid in enumerate(call["ids"]):
            seq, a = seqs[rid], int(call["pos"][i])
            if a < len(seq):
                assert int(call["anchors"][i]) == seq[a], "the anchor is not the token at anchor_pos"
                true_next = torch.tensor(seq[a + 1 : a + 1 + gamma], dtype=torch.long)
                truth[i, : len(true_next)] = true_next
                known[i, : len(true_next)] = True
        prop = forced_proposal(drafter, call["cache"], call["anchors"], call["pos"], truth, known, shared)
        for i, rid in enumerate(call["ids"]):
            m = known[i]
            if not m.any():
                continue
            a = int(call["pos"][i])
            logits, conf, labels, valid, target_pos, last_hidden = train[rid]
            j = a if eagle else sorted(anchors_of[rid]).index(a)
            n = int(m.sum())
            # The same labels and rows: draft k (1-based) is x_{a+k}, and training counts it.
            assert torch.equal(labels[j, :n], truth[i, :n]) and bool(valid[j, :n].all())
            # The logits, up to softmax's constant: the forced draws' log-probabilities times FORCE_T.
            z_train = logits[j, :n]
            z_inf = FORCE_T * prop.probs[i, :n].double().log()
            z_train = z_train.double() - z_train.double().logsumexp(-1, keepdim=True)
            z_inf = z_inf - z_inf.logsumexp(-1, keepdim=True)
            scale = float(z_train.abs().max())
            torch.testing.assert_close(z_inf, z_train, rtol=1e-4, atol=1e-4 * scale)
            if conf is not None:
                torch.testing.assert_close(prop.confidence_logits[i, :n], conf[j, :n], rtol=1e-4, atol=1e-5)
            # The engine's own greedy drafts: the argmax wherever the drafts before were true tokens.
            drafted = call["tokens"][i]
            agree = (drafted[: min(n, drafted.shape[0])] == truth[i, : min(n, drafted.shape[0])]).long()
            prefix = int(agree.cumprod(0).sum())
            upto = min(prefix + 1, n, drafted.shape[0])
            assert torch.equal(drafted[:upto], logits[j, :upto].argmax(-1))
            # The loss's target row for draft k is a+k-1, whose greedy token the engine emitted as x_{a+k}.
            assert torch.equal(target_pos[j, :n], a + torch.arange(n))
            greedy = (last_hidden[target_pos[j, :n]] @ shared.lm_weight.t()).argmax(-1)
            assert torch.equal(greedy, truth[i, :n])
            counted["rows"] += 1
            counted["positions"] += n
            counted["deep"] += max(0, n - 1)
            counted["greedy"] += upto
    return counted


def requests_for(target):
    prompts = prompts_for(target, 3, seed=4, lo=4, hi=9)
    return [Request(prompt=p, id=i, max_new_tokens=b) for i, (p, b) in enumerate(zip(prompts, [13, 9, 11]))]


def engine_for(kind, target, drafter):
    """The plain engine, or the fast one over its static cache (``fused``: through the fused
    inference paths, run eagerly on the CPU). Two slots for three requests (rows join, leave and
    move); the cycling policy drafts 0 (plain rounds, whose context the fast engine defers), then
    1..γ positions."""
    kw = dict(temperature=0.0, concurrency=2, eos_token_ids=(), seed=0, policy=Cycling())
    if kind == "plain":
        return Engine(target, drafter, **kw)
    if kind == "fused":
        drafter.compile_inference(compiler=None)
    return FastEngine(target, drafter, buckets=(1, 2), **kw)


@pytest.mark.parametrize("engine", ["plain", "fast", "fused"])
@pytest.mark.parametrize("name,head,slots", BLOCK_VARIANTS)
def test_block_drafter_trains_on_what_the_engine_drafts(small_target, monkeypatch, name, head, slots, engine):
    t = small_target
    drafter = build(t, name, head, slots)
    eng = engine_for(engine, t, drafter)
    seqs, calls = decode_and_capture(eng, drafter, requests_for(t), monkeypatch)
    counted = check_consistency(drafter, t, seqs, calls, Shared.of(t))
    assert counted["rows"] >= 10 and counted["deep"] >= 20, counted  # not vacuous


def test_eagle3_trains_on_what_the_engine_drafts(small_target, monkeypatch):
    """Eagle3's TTT rows (anchor a, step i) against its inference chain from anchor a, every step
    teacher-forced on both sides (plain engine: it has no static cache). This caught training's
    step-0 key at position 0 (x_0 with a zero feature), which inference never writes."""
    t = small_target
    drafter = build(t, "eagle3", "none", layers=1)
    seqs, calls = decode_and_capture(engine_for("plain", t, drafter), drafter, requests_for(t), monkeypatch)
    counted = check_consistency(drafter, t, seqs, calls, Shared.of(t))
    assert counted["rows"] >= 10 and counted["deep"] >= 20, counted


@pytest.mark.parametrize("shift", ["taps", "rotary"])
def test_the_comparison_catches_a_one_position_shift(small_target, monkeypatch, shift):
    """Controls: the engine's drafts, compared with training whose context taps are one position
    late (taps of p at p + 1), or drafted with the block's rotary positions one late, differ far
    beyond the tolerance: the checks above would see such a bug."""
    t = small_target
    drafter = build(t, "dspark", "rnn")
    seqs, calls = decode_and_capture(engine_for("plain", t, drafter), drafter, requests_for(t), monkeypatch)
    shared = Shared.of(t)
    if shift == "taps":
        features = online_features

        def late(batch, target):
            taps, last = features(batch, target)
            return torch.cat([torch.zeros_like(taps[:, :1]), taps[:, :-1]], 1), last

        monkeypatch.setattr("test_train_inference_consistency.online_features", late)
    else:
        propose = drafter.propose

        def late_block(cache, anchors, pos, *args, **kw):
            return propose(cache, anchors, pos + 1, *args, **kw)

        monkeypatch.setattr(drafter, "propose", late_block)
    with pytest.raises(AssertionError, match="not close"):
        check_consistency(drafter, t, seqs, calls, shared)
