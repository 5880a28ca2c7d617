"""The target's training forward through padded static buffers and CUDA graphs (feature_graphs)."""

import logging

import pytest
import torch
from conftest import load_group
from test_target import _host_reads

from dspark.feature_graphs import FeatureGraphs
from dspark.target import load_target


def _batch(lengths, vocab=1000, seed=0):
    """Right-padded rows of the given lengths (the training batch contract), width max(lengths)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(2, vocab, (n,), generator=g)
    return ids


def _padded(target, multiple, graphs=False):
    return FeatureGraphs(
        target.features, target.tap_dim, target.hidden_size, target.dtype, multiple, graphs=graphs
    )


def test_padding_to_a_multiple_leaves_every_real_position_as_it_was(tiny_target):
    """Each batch runs at its length rounded up, over whatever ids the buffer held past it (here the
    previous, longer batch's); causal attention keeps them out of the real positions. The buffers
    regrow when a batch outgrows them (more rows, a longer padded length) and keep their size when
    it fits. Nothing is read back to the host on the way."""
    padded = _padded(tiny_target, multiple=8)
    for lengths in ([13, 9], [5, 3], [8, 8], [17, 2, 11], [4]):
        ids = _batch(lengths, seed=len(lengths) * 100 + lengths[0])
        taps, last = padded(ids)
        ref_taps, ref_last = tiny_target.features(ids)
        assert taps.shape == ref_taps.shape and last.shape == ref_last.shape
        torch.testing.assert_close(taps, ref_taps, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(last, ref_last, rtol=1e-4, atol=1e-4)
    assert padded.padded_length(17) == 24 and padded.padded_length(8) == 8
    assert tuple(padded.ids.shape) == (3, 32)  # rows 2 -> 3; length 16 -> 32 (twice what was outgrown)
    with torch.no_grad():  # nothing read back to the host: a CUDA graph could not capture a read
        assert _host_reads(tiny_target, lambda: padded(_batch([9, 30, 1]))) == []


def test_the_caller_gets_copies_that_outlive_the_next_batch(tiny_target):
    """The buffers are rewritten by every batch; what `features` returned before must not change."""
    padded = _padded(tiny_target, multiple=16)
    first = _batch([10, 7], seed=1)
    taps, last = padded(first)
    kept = taps.clone(), last.clone()
    padded(_batch([12, 12], seed=2))
    torch.testing.assert_close(taps, kept[0], rtol=0, atol=0)
    torch.testing.assert_close(last, kept[1], rtol=0, atol=0)
    assert taps.data_ptr() != padded.taps.data_ptr()


def test_a_first_batch_inside_inference_mode_leaves_buffers_training_can_write(tiny_target):
    """Lightning's sanity check validates (inference mode) before the first training step (no_grad):
    buffers made in the first must take the second's writes."""
    padded = _padded(tiny_target, multiple=8)
    with torch.inference_mode():
        padded(_batch([6, 3]))
    assert not padded.ids.is_inference()
    with torch.no_grad():
        taps, _ = padded(_batch([7, 5], seed=3))
    ref = tiny_target.features(_batch([7, 5], seed=3))[0]
    torch.testing.assert_close(taps, ref, rtol=1e-4, atol=1e-4)


def test_graphs_off_cuda_warn_and_leave_the_forward_as_it_is(tiny_target, caplog):
    with caplog.at_level(logging.WARNING):
        assert FeatureGraphs.of(tiny_target) is None
    assert "CUDA graphs need a CUDA device" in caplog.text
    with pytest.raises(ValueError, match="graph_target_multiple"):
        _padded(tiny_target, multiple=0)


def test_a_failing_graph_path_goes_on_with_the_plain_forward(tiny_target, caplog):
    """A capture that fails (an operation CUDA graphs refuse, say) must not end a run: that batch and
    every later one run unpadded, as without graphs."""
    calls = []

    def refuses_padded(ids):
        calls.append(ids.shape[1])
        if ids.shape[1] % 8 == 0:  # the padded buffer's length
            raise RuntimeError("operation not permitted when stream is capturing")
        return tiny_target.features(ids)

    graphs = FeatureGraphs(refuses_padded, tiny_target.tap_dim, tiny_target.hidden_size, tiny_target.dtype, 8)
    with caplog.at_level(logging.WARNING):
        for lengths in ([6, 4], [13, 5]):
            ids = _batch(lengths)
            taps, last = graphs(ids)
            ref = tiny_target.features(ids)
            torch.testing.assert_close(taps, ref[0])
            torch.testing.assert_close(last, ref[1])
    assert graphs.failed and calls == [8, 6, 13] and "training goes on without them" in caplog.text
    assert graphs.bank is None and graphs.taps is None  # nothing held for the graphs any more


def test_each_fit_sets_the_target_forward_its_own_options_ask_for():
    """A target shared by several fits (the training-step bench's variants) takes each module's
    compile and graph options, not what an earlier module left on it."""
    from dspark.core.types import TargetDims
    from dspark.drafters import build_drafter
    from dspark.module import DraftingModule
    from dspark.objectives import LossWeights

    target = load_target(load_group("target", "tiny"))
    dims = TargetDims.of(target)
    drafter = build_drafter(dims, load_group("drafter", "dspark"), load_group("head", "markov"))
    weights = LossWeights.from_cfg(load_group("loss", "dspark"))
    optim = {"lr": 1e-3}

    def fit(**options):
        module = DraftingModule(target, drafter, weights, optim, **options)
        module.on_fit_start()
        return target._compiled_layers is not None, module.feature_graphs is not None

    assert fit(compile_target=True, graph_target=False) == (True, False)
    assert fit(compile_target=False, graph_target=False) == (False, False)
    assert fit(compile_target="auto", graph_target="auto") == (False, False)  # the CPU: neither
    assert fit(compile_target=True, graph_target=True) == (True, False)  # no graphs off CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_features_on_cuda_match_the_forward_they_replay(small_target):
    """On CUDA, around the compiled layers and under bf16 autocast as training runs them: the
    replayed graphs give what the same padded forward gives unreplayed (the same kernels: equal up
    to a bf16 rounding at most), and the unpadded forward's values up to bf16 rounding; one graph
    per (rows, padded length) met, captured again after the buffers regrow; a replay reads the
    batch it is given, not the one it was captured on."""
    target = small_target.to("cuda", dtype=torch.bfloat16)  # the GPU tests' target: no tokenizer to stage
    target.compile_features()
    graphs = FeatureGraphs.of(target, multiple=64)
    plain = _padded(target, multiple=64, graphs=False)
    met = set()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for step, lengths in enumerate(([40, 17, 33], [40, 17, 33], [70, 5, 64], [12, 12, 12], [129, 3, 90])):
            ids = _batch(lengths, vocab=target.vocab_size, seed=step).cuda()
            taps, last = graphs(ids)
            same_taps, same_last = plain(ids)
            torch.testing.assert_close(taps.float(), same_taps.float(), rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(last.float(), same_last.float(), rtol=1e-2, atol=1e-2)
            ref_taps, ref_last = target.features(ids)
            torch.testing.assert_close(taps.float(), ref_taps.float(), rtol=3e-2, atol=3e-2)
            torch.testing.assert_close(last.float(), ref_last.float(), rtol=3e-2, atol=3e-2)
            met.add((len(lengths), graphs.padded_length(max(lengths))))
    assert not graphs.failed
    # 64 and 128 captured, then 192 outgrew the buffers (length 128 -> 256): only 192's graph is left
    assert graphs.captured == 1 and tuple(graphs.ids.shape) == (3, 256) and len(met) == 3
