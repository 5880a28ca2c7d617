"""Draft vocabularies (``decoding.draft_vocab``): which tokens are chosen, how a drafter drafts among
them (its distribution is the whole vocabulary's conditioned on them, on every path), that decoding
with one stays lossless (greedy parity, the exact T = 1 distribution), that training and the
evaluation carry the counts they are chosen from, and training over one (``draft_vocab=K`` in train)."""

from __future__ import annotations

import json

import pytest
import torch
from test_drafter_contract import CASES, _with_context
from test_engine import N_SAMPLES, _first_three, assert_matches, exact_triples, make_drafter, prompts_for
from test_evaluate import _bench, _cfg, _save

from dspark.artifacts import DrafterFolder
from dspark.core.errors import ConfigError, DataError
from dspark.core.types import Shared
from dspark.data.tokenize import TokenSplit
from dspark.data.vocab_counts import load_draft_vocab, served_vocab_size
from dspark.decoding.draft_vocab import (
    answer_token_counts,
    check_draft_vocab,
    coverage,
    draft_vocab_from_counts,
    most_frequent,
)
from dspark.decoding.engine import Engine
from dspark.decoding.fast_engine import FastEngine
from dspark.evaluation import check_config
from dspark.kernels.fused_loss import RowWeights
from dspark.kernels.rejection import draft_row
from dspark.objectives import draft_target_distances, restrict_to_vocab


def test_most_frequent_takes_counts_then_lower_ids_and_keeps_the_forced_tokens():
    counts = torch.tensor([5, 0, 9, 5, 1, 7, 0, 2])
    assert most_frequent(counts, 3).tolist() == [0, 2, 5]  # 9, 7, then 5 twice: id 0 before 3
    assert most_frequent(counts, 3, always=[6]).tolist() == [2, 5, 6]  # the EOS displaces the last
    assert draft_vocab_from_counts(counts, 0) is None and draft_vocab_from_counts(counts, 8) is None
    with pytest.raises(ConfigError, match="cannot hold the tokens"):
        most_frequent(counts, 1, always=[1, 6])
    with pytest.raises(ConfigError, match="negative"):
        draft_vocab_from_counts(counts, -2)
    assert coverage(counts, torch.tensor([2, 5])) == pytest.approx(16 / 29)


def test_check_draft_vocab_names_what_is_wrong():
    assert check_draft_vocab(torch.tensor([1, 4, 9], dtype=torch.int32), 10).dtype == torch.long
    for bad, why in [
        (torch.tensor([3, 1]), "sorted ascending"),
        (torch.tensor([1, 1]), "unique"),
        (torch.tensor([0, 10]), r"outside \[0, 10\)"),
        (torch.tensor([]), "non-empty 1-D"),
        (torch.tensor([0.0, 1.0]), "token ids"),
    ]:
        with pytest.raises(ValueError, match=why):
            check_draft_vocab(bad, 10)


def test_answer_token_counts_count_the_trained_positions_only():
    ids = torch.tensor([1, 7, 7, 2, 3, 7, 9])
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0], dtype=torch.bool)
    split = TokenSplit(ids, mask, torch.tensor([0, 4, 7]), ["a", "b"], {})
    counts = answer_token_counts([split, split], 10)
    assert counts.tolist() == [0, 0, 2, 0, 0, 0, 0, 6, 0, 0]
    with pytest.raises(DataError, match="tokenised for another target"):
        answer_token_counts(
            [split], 7
        )  # a trained 7 is outside a vocabulary of 7 (the untrained 9 is not counted)


def _vocab(target, seed=3):
    """Half the ids, at random (a vocabulary that leaves out likely tokens too)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(target.vocab_size, generator=g)[: target.vocab_size // 2].sort().values


def _restricted(probs, vocab):
    kept = torch.zeros_like(probs)
    kept[..., vocab] = probs[..., vocab]
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
@pytest.mark.parametrize("name,head", CASES)
def test_a_drafter_drafts_the_whole_vocabularys_distribution_conditioned_on_its_draft_vocabulary(
    tiny_target, name, head, fused
):
    """The first drafted position (and every position of a parallel drafter, whose positions do
    not see each other's draws) has exactly the whole vocabulary's distribution restricted to the
    draft vocabulary and renormalised; every token is in it; the proposal's probabilities are over
    the vocabulary's K columns. The identity vocabulary changes nothing."""
    drafter, whole, cache, anchors, apos = _with_context(tiny_target, name, head, seed=4)
    if getattr(drafter, "head", None) is not None:
        torch.nn.init.normal_(drafter.head.W2.weight, std=0.5)  # a bias that matters
    if fused:
        if not drafter.supports_static_cache or name == "eagle3":
            pytest.skip("the fused draft step is the block drafters'")
        drafter.compile_inference(compiler=None)
    vocab = _vocab(tiny_target)
    part = Shared.of(tiny_target, vocab)
    same = Shared.of(tiny_target, torch.arange(tiny_target.vocab_size))
    u = torch.rand(anchors.shape[0], drafter.gamma, generator=torch.Generator().manual_seed(5))
    a = drafter.propose(cache, anchors, apos, whole, 1.0, uniforms=u)
    b = drafter.propose(cache, anchors, apos, part, 1.0, uniforms=u)
    c = drafter.propose(cache, anchors, apos, same, 1.0, uniforms=u)
    assert torch.equal(a.tokens, c.tokens)
    torch.testing.assert_close(a.probs, c.probs)
    assert torch.isin(b.tokens, vocab).all()
    assert b.probs.shape == (*a.probs.shape[:-1], len(vocab))
    wide = draft_row(b.probs.flatten(0, 1), part.index).view(*b.probs.shape[:2], -1)  # over V, 0 off it
    assert torch.equal(wide[..., vocab], b.probs)
    off = torch.ones(tiny_target.vocab_size, dtype=torch.bool)
    off[vocab] = False
    assert (wide[..., off] == 0).all()
    torch.testing.assert_close(b.probs.sum(-1), torch.ones(b.probs.shape[:-1]), atol=1e-4, rtol=0)
    parallel = name == "dflash"
    n = drafter.gamma if parallel else 1
    torch.testing.assert_close(wide[:, :n], _restricted(a.probs[:, :n], vocab), atol=1e-6, rtol=1e-4)
    greedy_whole = drafter.propose(cache, anchors, apos, whole, 0.0, uniforms=u)
    greedy_part = drafter.propose(cache, anchors, apos, part, 0.0, uniforms=u)
    assert torch.isin(greedy_part.tokens, vocab).all()
    want = torch.where(off, float("-inf"), a.probs[:, :n].log()).argmax(-1)  # argmax over the vocabulary
    assert torch.equal(greedy_part.tokens[:, :n], want)
    if b.confidence_logits is not None:  # the first confidence reads the anchor (a target id) alone
        torch.testing.assert_close(greedy_part.confidence_logits[:, 0], greedy_whole.confidence_logits[:, 0])


@pytest.mark.parametrize("engine", [Engine, FastEngine], ids=["plain", "fast"])
@pytest.mark.parametrize("kind", ["dspark-markov", "dflash", "eagle3"])
def test_greedy_output_with_a_draft_vocabulary_is_the_targets(small_target, kind, engine):
    t = small_target
    prompts = prompts_for(t, 4, seed=6)
    n = 24
    base = Engine(t, None, temperature=0, max_new_tokens=n, concurrency=4, eos_token_ids=()).generate(prompts)
    name, _, head = kind.partition("-")
    drafter = make_drafter(t, name, head or "none", gamma=4)[0]
    kw = {"compile": False} if engine is FastEngine else {}
    res = engine(
        t,
        drafter,
        temperature=0,
        max_new_tokens=n,
        concurrency=4,
        eos_token_ids=(),
        draft_vocab=_vocab(t),
        **kw,
    ).generate(prompts)
    for g, ref in zip(res.generations, base.generations):
        assert g.tokens == ref.tokens, f"{kind}: greedy output with a draft vocabulary differs"


@pytest.fixture(scope="module")
def stat_prompt():
    return [1, 57, 3, 201, 90]


@pytest.fixture(scope="module")
def exact(small_target, stat_prompt):
    return exact_triples(small_target, stat_prompt, N_SAMPLES)


@pytest.mark.parametrize("kind", ["dspark-markov", "eagle3"])
def test_sampling_with_a_draft_vocabulary_is_lossless(small_target, stat_prompt, exact, kind):
    """T = 1: the first three tokens' joint distribution is the target's, with half of the
    vocabulary undraftable (their mass comes from the residual alone)."""
    name, _, head = kind.partition("-")
    drafter = make_drafter(small_target, name, head or "none", gamma=4)[0]
    if head:
        torch.nn.init.normal_(drafter.head.W2.weight, std=0.5)
    samples, _ = _first_three(small_target, drafter, stat_prompt, seed=7, draft_vocab=_vocab(small_target))
    assert_matches(samples, exact, N_SAMPLES, f"{kind} with a draft vocabulary")


def test_engines_refuse_a_malformed_vocabulary(small_target):
    with pytest.raises(ValueError, match="sorted ascending"):
        Engine(small_target, None, draft_vocab=torch.tensor([5, 2]))


def test_evaluation_drafts_among_the_folders_most_frequent_tokens(tiny_target, tmp_path):
    """draft_vocab=K: refused before loading where no counts exist (the fix named), else the K most
    frequent of the folder's counts, recorded in results.json with their coverage."""
    from dspark import evaluate

    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "markov")
    with pytest.raises(ConfigError, match="draft_vocab_counts=<the data folder"):
        check_config(_cfg(f"drafter_dir={drafter}", "draft_vocab=64"))
    for where in (tmp_path / "none", tmp_path):  # missing; a folder without a tokenised training split
        with pytest.raises(ConfigError, match="neither a token counts file nor a data folder"):
            check_config(_cfg(f"drafter_dir={drafter}", "draft_vocab=64", f"draft_vocab_counts={where}"))
    counts = torch.zeros(tiny_target.vocab_size, dtype=torch.long)
    counts[100:164] = torch.arange(64, 0, -1)
    DrafterFolder(drafter).write_token_counts(counts)
    vocab, cov = load_draft_vocab(drafter, 64, tiny_target.vocab_size, always=tiny_target.eos_token_ids)
    assert set(tiny_target.eos_token_ids) <= set(vocab.tolist()) and len(vocab) == 64
    assert cov == pytest.approx(coverage(counts, vocab)) and 0.9 < cov < 1
    out = tmp_path / "out"
    cfg = _cfg(
        "target=tiny",
        f"drafter_dir={drafter}",
        "benchmarks=[gsm8k]",
        f"benchmark_dir={_bench(tmp_path / 'bench')}",
        "max_prompts=2",
        "max_new_tokens=8",
        "draft_vocab=64",
        "progress=false",
        f"out_dir={out}",
    )
    evaluate.run(cfg)
    res = json.loads((out / "results.json").read_text())
    assert res["draft_vocab"] == {"size": 64, "coverage": pytest.approx(cov, abs=1e-6)}
    assert res["benchmarks"]["gsm8k"]["tau"] >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["dspark-markov", "dspark-rnn", "dflash", "eagle3"])
def test_cuda_graphs_and_compiled_steps_keep_the_draft_vocabulary(small_target, kind, temperature):
    """On CUDA: captured rounds over a draft vocabulary replay the eager ones token for token; the
    compiled draft step (at T = 0 the greedy kernel over W2's rows of the vocabulary) keeps greedy
    output the target's own."""
    from dspark.decoding.engine import Request
    from dspark.scheduling.policies import Fixed

    t = small_target.to("cuda")
    try:
        name, _, head = kind.partition("-")
        drafter = make_drafter(t, name, head or "none", gamma=4, seed=3)[0].to("cuda")
        if head:
            torch.nn.init.normal_(drafter.head.W2.weight, std=0.5)
        prompts = prompts_for(t, 6, seed=14)
        reqs = [Request(prompt=p, max_new_tokens=b) for p, b in zip(prompts, [5, 30, 12, 21, 3, 17])]
        vocab = _vocab(t).to("cuda")

        def run(drafter_, **kw):
            gen = torch.Generator("cuda").manual_seed(7)
            common = dict(temperature=temperature, concurrency=4, eos_token_ids=(), draft_vocab=vocab)
            engine = FastEngine(t, drafter_, Fixed(None), generator=gen, **common, **kw)
            engine.prepare(reqs)
            return engine.generate(reqs)

        eager = run(drafter, graphs=False, compile=False)
        graphed = run(drafter, graphs=True, compile=False)
        assert [g.tokens for g in graphed.generations] == [g.tokens for g in eager.generations]
        if temperature == 0:
            compiled = run(drafter, graphs=True, compile=True)
            base = Engine(t, None, temperature=0, concurrency=4, eos_token_ids=()).generate(reqs)
            assert [g.tokens for g in compiled.generations] == [g.tokens for g in base.generations]
    finally:
        small_target.to("cpu")


def test_benchmarks_serve_the_drafter_with_its_draft_vocabulary(tiny_target, tmp_path, caplog):
    """e2e and engine_sps take --draft-vocab K (the drafter folder's counts, else the data folder's)
    and record it; a folder without counts is refused with the fix."""
    from dspark.bench import e2e, engine_sps

    drafter = _save(tiny_target, tmp_path / "drafter", "dspark", "markov")
    bench = _bench(tmp_path / "bench")
    common = ["--drafter-dir", str(drafter), "--draft-vocab", "64", "target=tiny"]
    with pytest.raises(ConfigError, match="draft_vocab_counts"):
        e2e.main(["--benchmark-dir", str(bench), "--out", str(tmp_path / "e.json"), *common])
    counts = torch.zeros(tiny_target.vocab_size, dtype=torch.long)
    counts[200:300] = 1
    DrafterFolder(drafter).write_token_counts(counts)
    report = e2e.main(
        ["--benchmark-dir", str(bench), "--prompts", "2", "--concurrency", "2", "--max-new-tokens", "4",
         "--repeats", "1", "--temperature", "1", "--out", str(tmp_path / "e2e.json"), *common]
    )  # fmt: skip
    assert report["draft_vocab"]["size"] == 64 and report["draft_vocab"]["coverage"] == pytest.approx(0.62)
    assert {r["run"] for r in report["rows"]} == {"target_only", "dspark/fixed"}
    table = tmp_path / "cost.json"
    sps = engine_sps.main(
        ["--tokens", "1,2", "--widths", "1", "--context", "8", "--repeats", "1", "--warmup", "0", "--no-hf",
         "--rounds", "1", "--out", str(tmp_path / "sps.json"), "--cost-table", str(table), *common]
    )  # fmt: skip
    assert sps["draft_vocab"]["size"] == 64 and sorted(int(r) for r in sps["draft_ms"]) == [1, 2]
    # a run priced by draft steps timed with another vocabulary is told so
    e2e_args = ["--benchmark-dir", str(bench), "--prompts", "1", "--concurrency", "1", "--max-new-tokens",
                "2", "--repeats", "1", "--out", str(tmp_path / "e.json"),
                "--cost-table", str(table)]  # fmt: skip
    with caplog.at_level("WARNING", logger="dspark.bench.e2e"):
        e2e.main([*e2e_args, *common])
        assert "draft vocabulary" not in caplog.text
        e2e.main([*e2e_args, "--drafter-dir", str(drafter), "target=tiny"])
        assert "timed with draft vocabulary {'size': 64" in caplog.text


@pytest.mark.parametrize("impl", ["materialized", "torch"])
def test_a_loss_over_a_draft_vocabulary_compares_both_distributions_over_its_tokens(impl):
    """draft_vocab=K in training: the draft and the target distributions are both over the K tokens
    (the target's renormalised there), CE counts only labels inside, and the trainable bias gets no
    gradient outside; the same on the plain-autograd and the fused path."""
    g = torch.Generator().manual_seed(0)
    v, d, r, n, m = 40, 8, 3, 12, 5
    lm, bias = torch.randn(v, d, generator=g), torch.randn(v, r, generator=g, requires_grad=True)
    x, th = torch.randn(n, d + r, generator=g), torch.randn(m, d, generator=g)
    index = torch.randint(0, m, (n,), generator=g)
    vocab = torch.tensor([1, 4, 5, 9, 17, 23, 30, 39])
    labels = torch.tensor([4, 39, 2, -1, 1, 30, 31, 5, 0, 17, 23, 9])  # 2, 31, 0 outside; -1 invalid
    weights = RowWeights(*(torch.rand(n, generator=g) for _ in range(3)))
    lw, bw, lab = restrict_to_vocab(lm, bias, labels, vocab)
    assert lab.tolist() == [1, 7, -1, -1, 0, 6, -1, 2, -1, 4, 5, 3]
    res = draft_target_distances(x, lw, bw, th, lab, weights, None, impl, target_index=index)
    res.loss.backward()

    logp_d = torch.log_softmax(x @ torch.cat([lm, bias.detach()], 1)[vocab].T, -1)
    p_t = torch.softmax(th[index] @ lm[vocab].T, -1)
    inside = lab >= 0
    ce = torch.where(inside, -logp_d.gather(1, lab.clamp_min(0)[:, None]).squeeze(1), torch.zeros(n))
    tv = (logp_d.exp() - p_t).abs().sum(-1)
    kl = (p_t * (p_t.log() - logp_d)).sum(-1)
    for ours, ref in ((res.ce, ce), (res.tv, tv), (res.kl, kl)):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.loss, (weights.ce * ce + weights.tv * tv + weights.kl * kl).sum())
    outside = torch.ones(v, dtype=torch.bool)
    outside[vocab] = False
    assert bias.grad[outside].abs().max() == 0 and bias.grad[vocab].abs().max() > 0
    assert restrict_to_vocab(lm, bias, labels, None)[2] is labels  # the whole vocabulary: unchanged


@pytest.mark.parametrize("drafter", ["dspark", "eagle3"])
def test_training_over_a_draft_vocabulary_is_served_with_it(tiny_target, smoke_data, tmp_path, drafter):
    """draft_vocab=K in training (the block loss and Eagle3's): the drafter folder records K, and an
    evaluation that names no vocabulary drafts among the same K tokens (draft_vocab=0: the whole)."""
    from test_training import cfg_for

    from dspark import evaluate
    from dspark.training import run_training

    out = tmp_path / "run"
    head = "head=markov" if drafter == "dspark" else "head=none"
    summary = run_training(
        cfg_for(out, smoke_data, f"drafter={drafter}", head, "trainer.max_steps=2", "draft_vocab=64")
    )
    assert summary["global_step"] == 2 and torch.isfinite(torch.tensor(summary["final"]["train/loss"]))
    folder = out / "drafter"
    assert DrafterFolder(folder).read_config()["draft_vocab"] == 64
    assert (served_vocab_size(None, folder), served_vocab_size(0, folder), served_vocab_size(32, folder)) == (
        64, 0, 32,
    )  # fmt: skip
    counts = DrafterFolder(folder).read_token_counts()
    trained = draft_vocab_from_counts(counts, 64, tiny_target.eos_token_ids)
    evals = tmp_path / "eval"
    cfg = _cfg(
        "target=tiny", f"drafter_dir={folder}", "benchmarks=[gsm8k]", "max_prompts=2", "max_new_tokens=8",
        f"benchmark_dir={_bench(tmp_path / 'b')}", "progress=false", f"out_dir={evals}",
    )  # fmt: skip
    evaluate.run(cfg)
    res = json.loads((evals / "results.json").read_text())
    assert res["draft_vocab"] == {"size": 64, "coverage": pytest.approx(coverage(counts, trained), abs=1e-6)}
