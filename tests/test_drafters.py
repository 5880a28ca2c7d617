"""Drafters: information flow, sampling exactness, losses against naive loops, gradients."""

import pytest
import torch
from conftest import head_group, load_group
from omegaconf import OmegaConf

from dspark.core.errors import ConfigError
from dspark.core.sampling import sample_from
from dspark.core.types import Shared, TargetDims
from dspark.drafters import build_drafter
from dspark.drafters.dflash import block_targets, packed_block_mask, packed_block_sparsity, sample_anchors
from dspark.objectives import LossWeights, block_loss, compute_loss, position_weights

VARIANTS = [
    ("dflash", "none"),
    ("dspark", "markov"),
    ("dspark", "gated"),
    ("dspark", "rnn"),
    ("eagle3", "none"),
]


def make(target, name, head, layers=1, gamma=4, rank=32):
    d = load_group("drafter", name)
    d.num_layers, d.block_size = layers, gamma
    if name == "eagle3":
        d.ttt_steps = gamma
    torch.manual_seed(0)
    h = head_group(head)
    if head != "none":
        h.rank = rank
    drafter = build_drafter(TargetDims.of(target), d, h)
    if getattr(drafter, "head", None) is not None:  # non-zero bias so the head matters in tests
        torch.nn.init.normal_(drafter.head.W2.weight, std=0.5)
    return drafter


@pytest.fixture(scope="module")
def batch(tiny_target):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 5000, (2, 24), generator=g)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, :3] = False
    step = tiny_target(ids)
    return ids, loss_mask, step


@pytest.mark.parametrize("name,head", VARIANTS)
def test_no_information_leak(tiny_target, batch, name, head):
    """Outputs for anchor a may only depend on tokens ≤ a (block inputs) and target features < a."""
    ids, lm, step = batch
    drafter = make(tiny_target, name, head).eval()
    shared = Shared.of(tiny_target)
    anchors = torch.tensor([[5, 9, 14], [4, 10, 16]])
    out = drafter.train_forward(step.taps, ids, lm, anchors, shared)
    ids2 = ids.clone()
    ids2[:, 12:] = torch.randint(100, 5000, ids2[:, 12:].shape)
    taps2 = step.taps.clone()
    taps2[:, 12:] = torch.randn_like(taps2[:, 12:])
    out2 = drafter.train_forward(taps2, ids2, lm, anchors, shared)
    # Anchors < 12 keep identical outputs; the teacher-forced previous tokens (true tokens inside the
    # block) are allowed to differ only where the block reaches position 12 or beyond.
    gamma = drafter.gamma
    for r in range(2):
        for j, a in enumerate(anchors[r].tolist()):
            k_ok = max(0, min(gamma, 12 - a))  # positions whose inputs all lie before 12
            if a >= 12 or k_ok == 0:
                continue
            if name == "dflash":
                k_ok = gamma if a < 12 else 0
            torch.testing.assert_close(out.features[r, j, :k_ok], out2.features[r, j, :k_ok])


def test_blocks_never_see_each_other(tiny_target, batch):
    ids, lm, step = batch
    drafter = make(tiny_target, "dflash", "none").eval()
    shared = Shared.of(tiny_target)
    base = drafter.train_forward(step.taps, ids, lm, torch.tensor([[5, 9], [5, 9]]), shared)
    alone = drafter.train_forward(step.taps, ids, lm, torch.tensor([[5, -1], [5, -1]]), shared)
    torch.testing.assert_close(base.features[:, 0], alone.features[:, 0])


def test_packed_mask_shape_and_semantics():
    m = packed_block_mask(torch.tensor([[2, 4]]), ctx_len=6, gamma=3)
    assert m.shape == (1, 6, 12)
    assert m[0, 0, :6].tolist() == [True, True, False, False, False, False]
    assert m[0, 3, :6].tolist() == [True, True, True, True, False, False]
    assert m[0, 0, 6:].tolist() == [True] * 3 + [False] * 3


@pytest.mark.parametrize("ctx_len,gamma,block", [(300, 7, 32), (256, 4, 64), (50, 16, 16)])
def test_flex_tiles_are_exactly_the_dense_mask_tiles(ctx_len, gamma, block):
    """The tiles flex attention visits (partial or full) are exactly those where the dense mask has
    any True entry, and the ones it treats as full are all True: nothing seen is skipped, nothing
    unseen is computed, no mask is applied where it would change something."""
    g = torch.Generator().manual_seed(ctx_len)
    lm = torch.rand(3, ctx_len, generator=g) < 0.8
    anchors = sample_anchors(lm, 40, g)
    anchors[2, 30:] = -1  # padding anchors, as a short sequence has
    dense = packed_block_mask(anchors, ctx_len, gamma)  # [B, Q, C+Q]
    b, q, kv = dense.shape
    pad = torch.zeros(b, -(-q // block) * block, -(-kv // block) * block, dtype=torch.bool)
    pad[:, :q, :kv] = dense
    tiles = pad.view(b, pad.shape[1] // block, block, pad.shape[2] // block, block)
    real = torch.zeros_like(pad)
    real[:, :q, :kv] = True
    real = real.view_as(tiles)
    any_true = tiles.any(4).any(2)
    all_true = (tiles | ~real).all(4).all(2)
    partial, full = packed_block_sparsity(anchors, ctx_len, gamma, block)
    assert torch.equal(partial[:, 0] | full[:, 0], any_true)
    assert not (partial & full).any()
    assert bool(all_true[full[:, 0]].all())


def test_eval_mask_is_contiguous():
    ids = torch.arange(10)[None]
    lm = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    _, labels, valid = block_targets(ids, lm, torch.tensor([[1, 7]]), 4)
    assert valid[0, 0].tolist() == [True, True, False, False]  # label pos 4 breaks the mask
    assert valid[0, 1].tolist() == [True, True, False, False]  # sequence ends at 9
    assert labels[0, 0, :2].tolist() == [2, 3]


def test_anchor_sampling_respects_mask():
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    a = sample_anchors(lm, 10, torch.Generator().manual_seed(0))
    assert sorted(x for x in a[0].tolist() if x >= 0) == [2, 3, 6]


def test_anchor_positions_count_where_sampling_can_start_a_block():
    """data's anchor_positions (what anchors_per_sequence=auto sizes the step by) counts per conversation
    exactly the positions sample_anchors draws from, and a pair across two conversations is none."""
    from dspark.data.datamodule import anchor_positions
    from dspark.data.tokenize import TokenSplit

    g = torch.Generator().manual_seed(7)
    lengths = [9, 1, 14, 6, 30]
    masks = [torch.rand(n, generator=g) < 0.7 for n in lengths]
    masks[0][-1] = masks[2][0] = True  # answer tokens on both sides of a boundary
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    split = TokenSplit(torch.zeros(sum(lengths), dtype=torch.long), torch.cat(masks), offsets, [], {})
    counts = anchor_positions(split)
    for mask, count in zip(masks, counts.tolist()):
        drawn = sample_anchors(mask[None], len(mask) + 1, torch.Generator().manual_seed(0))
        assert count == int((drawn >= 0).sum()) == int((mask[:-1] & mask[1:]).sum())


def test_as_many_anchors_as_positions_draw_what_512_draws():
    """anchors_per_sequence=auto's promise: with at least as many anchors as a conversation's positions,
    the step draws the anchors 512 would (all of them), only with fewer padding columns."""
    g = torch.Generator().manual_seed(3)
    lm = torch.rand(4, 300, generator=g) < 0.6
    most = int((lm[:, :-1] & lm[:, 1:]).sum(1).max())
    few = sample_anchors(lm, 64 * -(-most // 64), torch.Generator().manual_seed(1))
    many = sample_anchors(lm, 512, torch.Generator().manual_seed(1))
    assert torch.equal(many[:, : few.shape[1]], few) and bool((many[:, few.shape[1] :] == -1).all())


def test_anchors_per_sequence_auto_rounds_the_longest_answer_up_and_caps_it():
    from omegaconf import OmegaConf

    from dspark.training import anchors_per_sequence

    class Data:
        def __init__(self, most):
            self.most = most

        def most_anchor_positions(self):
            return self.most

    def resolved(setting, most, num_anchors=512):
        cfg = OmegaConf.create(
            {"data": {"anchors_per_sequence": setting}, "drafter": {"num_anchors": num_anchors}}
        )
        return anchors_per_sequence(cfg, Data(most))

    assert resolved("auto", 195) == 256 and resolved("auto", 256) == 256 and resolved("auto", 257) == 320
    assert resolved("auto", 440) == 448 and resolved("auto", 900) == 512 and resolved("auto", 0) == 64
    assert resolved("auto", 300, num_anchors=128) == 128  # never more than the drafter's
    assert resolved(128, 900) == 128 and resolved(None, 900) == 512  # a number or null: as before


@pytest.mark.parametrize("head", ["markov", "gated", "rnn", "rnn@2"])
def test_sampling_probabilities_are_exact(tiny_target, head):
    """The probs returned at position k are the softmax conditioned on the token sampled at k-1."""
    drafter = make(tiny_target, "dspark", head).eval()
    shared = Shared.of(tiny_target)
    ids = torch.randint(100, 5000, (3, 12))
    step = tiny_target(ids)
    cache = drafter.new_cache(3, "cpu")
    drafter.extend_context(
        cache, step.taps[:, :10], torch.arange(10).expand(3, -1), torch.ones(3, 10, dtype=torch.bool)
    )
    prop = drafter.propose(
        cache, ids[:, 10], torch.full((3,), 10), shared, 1.0, torch.Generator().manual_seed(1)
    )
    # Recompute teacher-forced with the sampled tokens as the previous tokens.
    x = drafter.block_inputs(ids[:, 10], shared)
    pos = 10 + torch.arange(drafter.gamma).expand(3, -1)
    mask = torch.ones(3, drafter.gamma, 10 + drafter.gamma, dtype=torch.bool)
    hidden = drafter.backbone(x, pos, list(zip(cache.k, cache.v)), mask)
    prev = torch.cat([ids[:, 10:11], prop.tokens[:, :-1]], 1)
    feats, conf = drafter.head_features(hidden, prev)
    weight = shared.lm_weight
    if drafter.bias_weight() is not None:
        weight = torch.cat([weight, drafter.bias_weight()], 1)
    logits = feats @ weight.t()
    torch.testing.assert_close(prop.probs, torch.softmax(logits.float(), -1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(prop.confidence_logits, conf, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(3, drafter.gamma), rtol=0, atol=1e-4)
    # The fused sampler draws by the shared convention (inverse CDF of the returned probs).
    u = torch.rand(3, drafter.gamma, generator=torch.Generator().manual_seed(1))
    assert torch.equal(prop.tokens, sample_from(prop.probs, u))


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_a_head_from_position_2_leaves_position_1_to_the_backbone(tiny_target, head):
    """head.first_position=2: position 1's draft distribution is the LM head's softmax of the
    backbone's state (the head's weights do not reach it), later positions carry the head's bias,
    and the RNN's state starts at position 2 (its features there are those of a block begun there)."""
    shared = Shared.of(tiny_target)
    drafter = make(tiny_target, "dspark", f"{head}@2").eval()
    hidden = torch.randn(3, drafter.gamma, tiny_target.hidden_size)
    anchor = torch.randint(100, 5000, (3,))
    u = torch.rand(3, drafter.gamma, generator=torch.Generator().manual_seed(2))

    def draw():
        with torch.no_grad():
            return drafter.sample_block(hidden, anchor, shared, 1.0, u)

    tokens, probs, _ = draw()
    plain = torch.softmax((hidden[:, 0] @ shared.lm_weight.t()).float(), -1)
    torch.testing.assert_close(probs[:, 0], plain, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        drafter.head.W2.weight.mul_(3.0)
    tokens3, probs3, _ = draw()
    torch.testing.assert_close(probs3[:, 0], probs[:, 0])
    assert not torch.allclose(probs3[:, 1:], probs[:, 1:], atol=1e-3)  # the head acts from position 2
    prev = torch.cat([anchor[:, None], tokens3[:, :-1]], 1)
    feats, _ = drafter.head_features(hidden, prev)
    bias = feats[..., tiny_target.hidden_size :]
    assert not bias[:, 0].any()
    torch.testing.assert_close(bias[:, 1:], drafter.head.sequence(hidden[:, 1:], prev[:, 1:]))


def test_head_first_position_must_be_a_draft_position(tiny_target):
    from dspark.drafters.registry import check_drafter_config

    d = load_group("drafter", "dspark")
    d.block_size = 4  # slots=anchor: γ = 4
    cases = ((4, None), (5, "head.first_position=5 is not a draft position"), (0, "first_position"))
    for first, error in cases:
        h = head_group(f"markov@{first}")
        if error is None:
            check_drafter_config(d, h)
        else:
            with pytest.raises(ConfigError, match=error):
                check_drafter_config(d, h)


def test_rnn_state_carries(tiny_target):
    drafter = make(tiny_target, "dspark", "rnn")
    h = torch.randn(2, 4, tiny_target.hidden_size)
    prev = torch.randint(0, 1000, (2, 4))
    b1 = drafter.head.sequence(h, prev)
    prev2 = prev.clone()
    prev2[:, 0] += 1  # changes the state after position 0
    b2 = drafter.head.sequence(h, prev2)
    assert not torch.allclose(b1[:, 2], b2[:, 2])  # felt two steps later: the state carried it
    markov = make(tiny_target, "dspark", "markov")
    m1, m2 = markov.head.sequence(h, prev), markov.head.sequence(h, prev2)
    torch.testing.assert_close(m1[:, 2], m2[:, 2])  # memoryless


@pytest.mark.parametrize(
    "name,head,kl",
    [("dflash", "none", 0.0), ("dflash", "none", 0.4), ("dspark", "markov", 0.3), ("dspark", "rnn", 0.0)],
)
def test_block_loss_equals_naive_loop(tiny_target, batch, name, head, kl):
    ids, lm, step = batch
    drafter = make(tiny_target, name, head)
    shared = Shared.of(tiny_target)
    anchors = torch.tensor([[3, 8, 20], [6, 11, -1]])
    out = drafter.train_forward(step.taps, ids, lm, anchors, shared)
    w = LossWeights.from_cfg(load_group("loss", "dspark" if name == "dspark" else "dflash"))
    w.impl, w.kl = "materialized", kl
    got = block_loss(out, step.last_hidden, tiny_target.lm_head_weight, None, w)
    # Naive: loop over every (sequence, anchor, k) and accumulate.
    pw = position_weights(drafter.gamma, w.gamma_decay)
    num = {"ce": 0.0, "tv": 0.0, "kl": 0.0, "conf": 0.0}
    den = 0.0
    logits = out.logits(tiny_target.lm_head_weight)
    for r in range(2):
        for j, a in enumerate(anchors[r].tolist()):
            if a < 0:
                continue
            for k in range(drafter.gamma):
                t = a + k + 1
                if t >= ids.shape[1] or not bool(lm[r, a + 1 : t + 1].all()):
                    break
                p_d = torch.softmax(logits[r, j, k], -1)
                p_t = torch.softmax(tiny_target.lm_head(step.last_hidden[r, a + k]), -1)
                tv = (p_d - p_t).abs().sum()
                num["ce"] += pw[k] * -torch.log(p_d[ids[r, t]])
                num["tv"] += pw[k] * tv
                num["kl"] += pw[k] * (p_t * (p_t.log() - p_d.log())).sum()
                if out.confidence_logits is not None:
                    c = torch.sigmoid(out.confidence_logits[r, j, k])
                    cs = (1 - tv / 2).detach()
                    num["conf"] += pw[k] * -(cs * torch.log(c) + (1 - cs) * torch.log(1 - c))
                den += pw[k]
    torch.testing.assert_close(got["ce"], (num["ce"] / den).detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["tv"], (num["tv"] / den).detach(), rtol=1e-4, atol=1e-5)
    assert ("kl" in got) == (kl > 0)  # logged only where it is trained
    if kl:
        torch.testing.assert_close(got["kl"], (num["kl"] / den).detach(), rtol=1e-4, atol=1e-5)
    if out.confidence_logits is not None:
        torch.testing.assert_close(got["conf_loss"], (num["conf"] / den).detach(), rtol=1e-4, atol=1e-5)
    total = w.ce * num["ce"] + w.tv * num["tv"] + kl * num["kl"] + w.confidence * num["conf"]
    torch.testing.assert_close(got["loss"], total / den, rtol=1e-4, atol=1e-5)


def test_kl_weight_left_out_is_the_loss_kind_s_own():
    """Eagle3 trains on KL alone, a block drafter on none unless asked (eq. 12 has no KL term): a
    loss config written before block drafters had the key keeps its meaning."""
    block = {"kind": "block", "ce": 0.1, "tv": 0.9, "confidence": 1.0}
    assert LossWeights.from_cfg(OmegaConf.create(block)).kl == 0.0
    assert LossWeights.from_cfg(OmegaConf.create({"kind": "eagle3"})).kl == 1.0
    assert LossWeights.from_cfg(OmegaConf.create({**block, "kl": 0.5})).kl == 0.5
    assert LossWeights.from_cfg(load_group("loss", "eagle3")).kl == 1.0
    for name in ("dspark", "dflash"):
        assert LossWeights.from_cfg(load_group("loss", name)).kl == 0.0
    nothing = {**block, "ce": 0, "tv": 0, "confidence": 0}
    with pytest.raises(ConfigError, match="nothing to train on"):
        LossWeights.from_cfg(OmegaConf.create(nothing))
    assert LossWeights.from_cfg(OmegaConf.create({**nothing, "kl": 1})).kl == 1


def test_position_weights_decay_by_the_block_when_none(tiny_target, batch):
    """loss.gamma_decay=null: w_k = exp(-(k-1)/γ) with the block's own γ (the paper's eq. as written),
    the same loss as that γ given as a number, and not the default's 4."""
    torch.testing.assert_close(position_weights(16, None), torch.exp(-torch.arange(16.0) / 16))
    ids, lm, step = batch
    drafter = make(tiny_target, "dspark", "markov", gamma=6)
    anchors = torch.tensor([[3, 8, 20], [6, 11, -1]])
    out = drafter.train_forward(step.taps, ids, lm, anchors, Shared.of(tiny_target))
    losses = {}
    for decay in (None, float(drafter.gamma), 4.0):
        cfg = load_group("loss", "dspark")
        cfg.gamma_decay, cfg.impl = decay, "materialized"
        w = LossWeights.from_cfg(cfg)  # the schema takes null
        losses[decay] = block_loss(out, step.last_hidden, tiny_target.lm_head_weight, None, w)["loss"]
    torch.testing.assert_close(losses[None], losses[float(drafter.gamma)])
    assert not torch.allclose(losses[None], losses[4.0])


@pytest.mark.parametrize("detached", [False, True])
def test_confidence_loss_trains_the_backbone_unless_detached(tiny_target, batch, detached):
    """The paper trains the confidence head through the backbone's hidden states and the Markov
    embedding it reads; ``confidence.detach_features`` keeps that loss to the head's own weights
    (the ablation of DSpark's position-1 acceptance) and leaves the confidences themselves as they were."""
    ids, lm, step = batch
    d = load_group("drafter", "dspark")
    d.num_layers, d.block_size, d.confidence.detach_features = 1, 4, detached
    h = load_group("head", "markov")
    h.rank = 32
    torch.manual_seed(0)
    drafter = build_drafter(TargetDims.of(tiny_target), d, h)
    anchors = sample_anchors(lm, 6, torch.Generator().manual_seed(0))
    out = drafter.train_forward(step.taps, ids, lm, anchors, Shared.of(tiny_target))
    out.confidence_logits.sum().backward()
    reached = {n for n, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    own = {"confidence.proj.weight", "confidence.proj.bias"}
    assert {n for n in reached if n.startswith("confidence.")} == own
    others = reached - own
    if detached:
        assert others == set()
    else:
        assert "head.W1.weight" in others and any(n.startswith("layers.") for n in others), others
    d.confidence.detach_features = not detached  # the same weights the other way: equal confidences
    torch.manual_seed(0)
    twin = build_drafter(TargetDims.of(tiny_target), d, h)
    twin.load_state_dict(drafter.state_dict())
    again = twin.train_forward(step.taps, ids, lm, anchors, Shared.of(tiny_target))
    torch.testing.assert_close(again.confidence_logits, out.confidence_logits)


@pytest.mark.parametrize("name,head", VARIANTS)
def test_gradients_reach_exactly_trainable_params(tiny_target, batch, name, head):
    ids, lm, step = batch
    drafter = make(tiny_target, name, head)
    shared = Shared.of(tiny_target)
    out = drafter.train_forward(
        step.taps, ids, lm, sample_anchors(lm, 6, torch.Generator().manual_seed(0)), shared
    )
    loss_name = {"dflash": "dflash", "dspark": "dspark", "eagle3": "eagle3"}[name]
    m = compute_loss(
        out,
        step.last_hidden,
        tiny_target.lm_head_weight,
        None,
        LossWeights.from_cfg(load_group("loss", loss_name)),
    )
    m["loss"].backward()
    for pname, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{pname} got no gradient"
    assert all(p.grad is None for p in tiny_target.parameters())
    assert not any(p.requires_grad for p in tiny_target.parameters())
    names = set(dict(drafter.named_parameters()))
    assert not any(n.startswith(("embed_tokens", "lm_head")) or ".embed_tokens" in n for n in names)
    assert not any(p is tiny_target.embedding_weight for p in drafter.parameters())


def test_fused_and_materialized_losses_agree(tiny_target, batch):
    ids, lm, step = batch
    drafter = make(tiny_target, "dspark", "markov")
    shared = Shared.of(tiny_target)
    anchors = sample_anchors(lm, 8, torch.Generator().manual_seed(0))
    w = LossWeights.from_cfg(load_group("loss", "dspark"))
    w.kl = 0.5  # rows with every term: CE, TV and KL
    results = {}
    for impl in ("materialized", "torch"):
        drafter.zero_grad()
        w.impl = impl
        out = drafter.train_forward(step.taps, ids, lm, anchors, shared)
        m = block_loss(out, step.last_hidden, tiny_target.lm_head_weight, None, w)
        m["loss"].backward()
        results[impl] = (
            m["loss"].detach(),
            drafter.head.W2.weight.grad.clone(),
            drafter.fc.weight.grad.clone(),
        )
    for a, b in zip(results["materialized"], results["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["dflash", "eagle3"])
def test_fused_loss_computes_each_shared_target_once_and_agrees(tiny_target, batch, name, monkeypatch):
    """A sequence's rows share its positions' target distributions (anchors overlap; Eagle3 compares
    γ rows with each position): the fused loss computes each position's target logits once and
    agrees with the materialised loss, which gathers one target per row (the old computation)."""
    from dspark.kernels import fused_loss

    ids, lm, step = batch
    drafter = make(tiny_target, name, "none")
    shared = Shared.of(tiny_target)
    anchors = sample_anchors(lm, 8, torch.Generator().manual_seed(0))
    w = LossWeights.from_cfg(load_group("loss", name))
    target_rows = []
    torch_rows = fused_loss._ROW_PASSES["torch"]

    def spy(zd, zt, *args):
        target_rows.append((zd.shape[0], zt.shape[0]))
        return torch_rows(zd, zt, *args)

    monkeypatch.setitem(fused_loss._ROW_PASSES, "torch", spy)
    results = {}
    for impl in ("materialized", "torch"):
        drafter.zero_grad()
        w.impl = impl
        out = drafter.train_forward(step.taps, ids, lm, anchors, shared)
        m = compute_loss(out, step.last_hidden, tiny_target.lm_head_weight, None, w)
        m["loss"].backward()
        results[impl] = (m["loss"].detach(), m["tv"], drafter.fc.weight.grad.clone())
    rows = out.valid.numel()
    assert target_rows == [(rows, ids.numel())]  # one target row per position of the 2 sequences
    assert ids.numel() < rows
    for a, b in zip(results["materialized"], results["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_training_raises_tau_prob(tiny_target):
    """A few hundred steps on a short repeated text: the drafter learns the target's distributions
    there, so the expected acceptance length τ_prob climbs well above where it started."""
    from dspark.module import DraftingModule

    text = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 6
    ids = torch.tensor([tiny_target.tokenizer(text)["input_ids"][:64]])
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids, dtype=torch.bool),
    }
    drafter = make(tiny_target, "dspark", "markov", layers=1, gamma=4)
    module = DraftingModule(
        tiny_target, drafter, LossWeights.from_cfg(load_group("loss", "dspark")), {}, num_anchors=16
    )
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    torch.manual_seed(0)
    taus = []
    for _ in range(200):
        m = module._step(batch)
        opt.zero_grad()
        m["loss"].backward()
        opt.step()
        taus.append(float(m["tau_prob"]))
    start, end = sum(taus[:5]) / 5, sum(taus[-5:]) / 5
    print(f"tau_prob {start:.2f} -> {end:.2f}")
    assert end > 1.6 * start, (start, end)  # measured: 1.06 -> 2.09


@pytest.mark.parametrize("head", ["none", "rnn"])
def test_flex_attention_equals_dense_mask(tiny_target, batch, head):
    """The flex-attention block mask and the dense boolean mask give the same drafts."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    ids, lm, step = batch
    drafter = make(tiny_target, "dspark", head).eval()
    shared = Shared.of(tiny_target)
    anchors = torch.tensor([[3, 8, 20], [6, 11, -1]])
    outs = {}
    for backend in ("dense", "flex"):
        drafter.attention = backend
        with torch.no_grad():  # flex has no CPU backward; the GPU run trains through it
            outs[backend] = drafter.train_forward(step.taps, ids, lm, anchors, shared).features
    torch.testing.assert_close(outs["flex"], outs["dense"], rtol=1e-4, atol=1e-5)


def test_anchors_have_one_width_whatever_the_length():
    """A batch shorter than num_anchors still gets num_anchors columns (the extra ones -1), so the
    compiled training step sees one query length."""
    lm = torch.ones(2, 5, dtype=torch.bool)
    a = sample_anchors(lm, 8, torch.Generator().manual_seed(0))
    assert a.shape == (2, 8)
    assert all(sorted(x for x in row if x >= 0) == [0, 1, 2, 3] for row in a.tolist())
    assert (a[:, 4:] == -1).all()


def test_training_layers_compile_once_for_every_batch_shape(tiny_target):
    """`compile_for_training`: one graph for batches of any context length and anchor count (the
    first shape used to be specialised, then recompiled, ~10 s each on the H200). Dynamo's frame
    counter is the compiler here; flex attention has no CPU backward, so forward only."""
    from torch._dynamo.testing import CompileCounter

    from dspark.drafters.dflash import compile_for_training, flex_block_mask
    from dspark.drafters.layers import DraftLayer

    drafter = make(tiny_target, "dspark", "markov")
    layer: DraftLayer = drafter.layers[0]
    counter = CompileCounter()
    compiled = compile_for_training(layer, backend=counter)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    gamma = drafter.block_size
    # At least 2 query tiles and 3 to 5 key tiles (dynamic sizes still specialise a size of 1).
    n = -(-256 // gamma)
    for t in (40, 150, 12, 300):
        lm = torch.rand(2, t, generator=g) < 0.9
        anchors = sample_anchors(lm, n, g)
        x = torch.randn(2, n * gamma, layer.attn.s.hidden_size)
        pos = (anchors.clamp(min=0)[..., None] + torch.arange(gamma)).flatten(1)
        with torch.no_grad():
            ctx = torch.randn(2, t, layer.attn.s.hidden_size)
            ctx_kv = layer.context_kv(ctx, torch.arange(t).expand(2, -1))
            compiled(x, pos, ctx_kv, flex_block_mask(anchors, t, gamma))
    assert counter.frame_count == 1


def test_validation_runs_the_draft_layers_eagerly(tiny_target):
    """Training on CUDA runs compiled wrappers of the draft layers; a step without grad (validation,
    the sanity check) runs the layers themselves, so no second set of graphs is compiled for it."""
    drafter = make(tiny_target, "dspark", "markov")
    drafter.compile_training = True
    cuda = torch.device("cuda")  # a device name only: wrapping compiles nothing until called
    compiled = drafter.training_layers(cuda)
    assert len(compiled) == len(drafter.layers)
    assert all(c is not layer and c._orig_mod is layer for c, layer in zip(compiled, drafter.layers))
    with torch.no_grad():
        assert all(a is b for a, b in zip(drafter.training_layers(cuda), drafter.layers))
    assert drafter.training_layers(cuda) is compiled  # made once
    assert all(a is b for a, b in zip(drafter.training_layers(torch.device("cpu")), drafter.layers))


def test_every_draft_layer_trains_on_an_input_that_requires_grad(tiny_target, batch):
    """Dynamo guards on an input's requires_grad: the first layer's input (frozen embeddings of the
    block's tokens) would take a graph of its own beside the later layers'. Under no grad nothing
    is made to require one."""
    ids, lm, step = batch
    drafter = make(tiny_target, "dspark", "markov")
    seen = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].requires_grad))
        for layer in drafter.layers
    ]
    anchors = torch.tensor([[5, 9], [4, 10]])
    drafter.train_forward(step.taps, ids, lm, anchors, Shared.of(tiny_target))
    assert seen == [True] * len(drafter.layers)
    seen.clear()
    with torch.no_grad():
        drafter.train_forward(step.taps, ids, lm, anchors, Shared.of(tiny_target))
    assert seen == [False] * len(drafter.layers)
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize("with_mask", [True, False])
def test_grouped_query_attention_folds_heads_instead_of_repeating_keys(with_mask):
    """The draft layer's attention with G = 3 query heads per KV head (context keys before the
    draft's own, a ragged mask) equals attention over keys and values repeated per query head."""
    import torch.nn.functional as F

    from dspark.drafters.layers import Attention, LayerShape, apply_rope, rope

    torch.manual_seed(0)
    s = LayerShape(
        hidden_size=48, intermediate_size=96, num_heads=6, num_kv_heads=2, head_dim=8, rope_theta=1e4
    )
    attn = Attention(s)
    b, t, c = 3, 4, 5
    x = torch.randn(b, t, 48)
    pos = torch.arange(c, c + t).expand(b, -1)
    ctx = (torch.randn(b, 2, c, 8), torch.randn(b, 2, c, 8))
    mask = torch.rand(b, t, c + t) > 0.3 if with_mask else None
    if mask is not None:
        mask[..., c:] = True  # every query sees the block (and so at least one key)
    out, (k_self, v_self) = attn(x, pos, ctx, mask)

    q = attn.q_norm(attn._heads(attn.q_proj(x), 6))
    cos, sin = rope(pos, 8, 1e4)
    q = apply_rope(q, cos, sin)
    k = torch.cat([ctx[0], k_self], dim=2).repeat_interleave(3, dim=1)
    v = torch.cat([ctx[1], v_self], dim=2).repeat_interleave(3, dim=1)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None])
    ref = attn.o_proj(ref.transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if mask is not None:  # the mask matters: without it the output differs
        unmasked, _ = attn(x, pos, ctx, None)
        assert not torch.allclose(unmasked, out, atol=1e-3)


@pytest.mark.parametrize("ctx_len,gamma", [(300, 7), (41, 4), (700, 16)])
def test_flex_block_mask_is_the_block_mask_torch_builds_from_the_tiles(ctx_len, gamma):
    """`flex_block_mask` sorts the key-major and query-major tiles itself; the BlockMask is the one
    ``BlockMask.from_kv_blocks`` builds from the key-major ones (its query-major tiles through
    torch's own transpose), tensor for tensor."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import BlockMask

    from dspark.drafters.dflash import FLEX_BLOCK, flex_block_mask

    g = torch.Generator().manual_seed(ctx_len)
    lm = torch.rand(3, ctx_len, generator=g) < 0.8
    anchors = sample_anchors(lm, 40, g)
    anchors[2, 25:] = -1  # padding anchors, as a short sequence has

    def ordered(tiles):  # what the step did before: each direction its own argsort
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return tiles.sum(-1, dtype=torch.int32), order

    partial, full = packed_block_sparsity(anchors, ctx_len, gamma)
    q_len = anchors.shape[1] * gamma
    ref = BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=FLEX_BLOCK, seq_lengths=(q_len, ctx_len + q_len)
    )
    got = flex_block_mask(anchors, ctx_len, gamma)
    assert got.seq_lengths == ref.seq_lengths and tuple(got.BLOCK_SIZE) == tuple(ref.BLOCK_SIZE)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):  # fmt: skip
        a, b = getattr(got, name), getattr(ref, name)
        assert a.dtype == b.dtype == torch.int32 and a.is_contiguous(), name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name,head", [("dflash", "none"), ("dspark", "markov")])
def test_training_context_is_every_layer_s_context_kv(tiny_target, batch, name, head):
    """The context keys and values of every layer at once equal each layer's own `context_kv` of
    `context(taps)` (to the rounding of one GEMM against the stacked weights instead of one per
    layer), gradients included, and each is a contiguous tensor of its own."""
    ids, lm, step = batch
    drafter = make(tiny_target, name, head, layers=3)
    for layer in drafter.layers:  # distinct k_norm weights, so a mixed-up layer would show
        torch.nn.init.normal_(layer.attn.k_norm.weight, mean=1.0, std=0.3)
    taps = step.taps.detach().requires_grad_()
    got = drafter.training_context_kv(taps)
    b, t = ids.shape
    ctx = drafter.context(taps)
    ref = [layer.context_kv(ctx, torch.arange(t).expand(b, -1)) for layer in drafter.layers]
    assert len(got) == len(ref) == 3
    for (k, v), (rk, rv) in zip(got, ref):
        assert k.is_contiguous() and v.is_contiguous() and k._base is None and v._base is None
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-6)
    params = [taps, *drafter.parameters()]
    weights = [torch.randn_like(k) for kv in ref for k in kv]

    def grads(kvs):
        loss = sum((w * x).sum() for w, x in zip(weights, [x for kv in kvs for x in kv]))
        return torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)

    for a, r in zip(grads(got), grads(ref)):
        assert (a is None) == (r is None)
        if a is not None:  # sums over every position: rounding relative to the gradient's scale
            torch.testing.assert_close(a, r, rtol=1e-3, atol=1e-5 * float(r.abs().max()))
    # The RoPE table is sliced from one grown per device: the same numbers as computing it anew.
    from dspark.drafters.layers import rope

    drafter.rope_table(3 * t, "cpu")
    cos, sin = drafter.rope_table(t, "cpu")
    s = drafter.layers[0].attn.s
    ref_cos, ref_sin = rope(torch.arange(t), s.head_dim, s.rope_theta)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_cached_training_tables_survive_a_first_call_under_inference_mode(tiny_target, batch):
    """The RoPE table and the block-mask tile layout are cached across steps: made by a first call
    under inference mode (a stand-alone validation), they must still serve a training step."""
    from dspark.drafters.dflash import flex_block_mask

    ids, lm, step = batch
    drafter = make(tiny_target, "dspark", "markov", layers=2)
    anchors = torch.tensor([[3, 8, -1], [2, 9, 14]])
    t = ids.shape[1] + 5  # a length no other test has cached
    taps = torch.randn(2, t, step.taps.shape[-1])
    with torch.inference_mode():
        drafter.training_context_kv(taps)
        flex_block_mask(anchors, t, drafter.block_size)
    sum(k.sum() + v.sum() for k, v in drafter.training_context_kv(taps)).backward()
    assert not flex_block_mask(anchors, t, drafter.block_size).kv_indices.is_inference()


def _top_level_ops(fn) -> list[str]:
    """The operators ``fn`` dispatches from Python (not those they run inside), on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]


def test_training_masks_and_context_take_few_host_operators(tiny_target):
    """Host work per step, which bounds a small drafter's GPU step: the flex block mask (from
    ``BlockMask.from_kv_blocks``: ~90 operators) and every layer's context keys and values (layer
    by layer: ~40 operators a layer) stay small, whatever the number of layers."""
    from dspark.drafters.dflash import flex_block_mask

    drafter = make(tiny_target, "dspark", "markov", layers=5)
    g = torch.Generator().manual_seed(0)
    anchors = sample_anchors(torch.rand(4, 200, generator=g) < 0.9, 64, g)
    flex_block_mask(anchors, 200, 7)  # the shape's tile layout, cached from then on
    assert len(_top_level_ops(lambda: flex_block_mask(anchors, 200, 7))) <= 30
    taps = torch.randn(4, 200, tiny_target.tap_dim)
    drafter.training_context_kv(taps)
    ops = _top_level_ops(lambda: drafter.training_context_kv(taps))
    assert len(ops) <= 70, ops


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_flex_training_mask_matches_dense_forward_and_backward(compiled, small_target):
    """On CUDA, as the training step runs it: the flex block mask built from the tiles
    (``flex_block_mask``: both the key-major indices of the forward and the query-major ones of the
    backward) gives the dense mask's features and gradients, over several 128-tiles of context and
    blocks, with the draft layers eager and compiled. The target needs no tokenizer (the GPU machine
    has no offline target package)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = small_target.to("cuda")
    try:
        _flex_mask_against_dense(target, compiled)
    finally:
        small_target.to("cpu")


def _flex_mask_against_dense(target, compiled):
    drafter = make(target, "dspark", "markov", layers=2, gamma=7).cuda().float()
    drafter.compile_training = compiled
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(4, target.vocab_size, (2, 300), device="cuda", generator=g)
    lm = torch.ones_like(ids, dtype=torch.bool)
    lm[0, :40], lm[1, 250:] = False, False
    step = target(ids)
    anchors = sample_anchors(lm, 48, g)
    shared = Shared.of(target)
    got = {}
    for backend in ("dense", "flex"):
        drafter.attention = backend
        drafter.zero_grad(set_to_none=True)
        out = drafter.train_forward(step.taps, ids, lm, anchors, shared)
        (out.features.float().pow(2) * out.valid[..., None]).mean().backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        got[backend] = (out.features.detach(), grads)
    torch.testing.assert_close(got["flex"][0], got["dense"][0], rtol=1e-4, atol=1e-4)
    assert got["flex"][1].keys() == got["dense"][1].keys() and got["dense"][1]
    for name, grad in got["dense"][1].items():
        torch.testing.assert_close(got["flex"][1][name], grad, rtol=1e-3, atol=1e-5, msg=name)
