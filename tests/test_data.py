"""Data pipeline: prompt sources and filters, benchmarks, chat-template loss masks, regeneration
shards (resume, failing writes), prepare/ensure_dataset. Runs on the tiny target (seconds)."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dspark.core.errors import DataError
from dspark.core.io import atomic_open, atomic_write_jsonl
from dspark.data import benchmarks as bm
from dspark.data.prompts import (
    PromptFilter,
    is_degenerate,
    load_hub_prompts,
    magpie_prefix,
    read_prompt_jsonl,
    self_generate_prompts,
    split_train_val,
)
from dspark.data.regenerate import (
    Continuation,
    Sampling,
    generate_continuations,
    load_conversations,
    nucleus,
    regenerate,
)
from dspark.data.tokenize import (
    TemplateError,
    end_markers,
    prompt_ids,
    tokenize_conversation,
)

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT.parent / "shared" / "benchmarks"


def target_cfg(name: str):
    cfg = OmegaConf.load(ROOT / "conf" / "target" / f"{name}.yaml")
    cfg.device = "cpu"
    return cfg


def data_cfg(tmp: Path, **over):
    cfg = OmegaConf.load(ROOT / "conf" / "data" / "quick.yaml")
    cfg.dir = str(tmp)
    cfg.benchmark_dir = str(BENCH) if BENCH.is_dir() else None
    for k, v in over.items():
        OmegaConf.update(cfg, k, v, force_add=True)
    return cfg


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return tiny_target  # conftest's session-wide tiny target (one torch thread)


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny.tokenizer


# ----------------------------------------------------------------------------------------------
# benchmarks


needs_bench = pytest.mark.skipif(not BENCH.is_dir(), reason=f"no benchmark folder at {BENCH}")


@needs_bench
def test_benchmarks_load_by_name_and_domains():
    assert set(bm.DOMAINS) == {p.stem for p in BENCH.glob("*.jsonl")}
    turns = bm.first_turns("gsm8k", BENCH)
    assert len(turns) == 1319 and turns[0].startswith("Janet")
    assert len(bm.first_turns("mt-bench", BENCH, max_prompts=5)) == 5
    assert len(bm.load_benchmark("mt-bench", BENCH)[0]) == 2  # all turns kept by load_benchmark


def test_benchmark_hub_fallback_errors_clearly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(DataError, match="pip install datasets"):
        bm.load_benchmark("gsm8k", tmp_path)
    with pytest.raises(DataError, match="unknown benchmark"):
        bm.load_benchmark("nope", tmp_path)


def test_benchmark_hub_offline_errors_clearly(tmp_path, monkeypatch):
    class FakeDatasets:
        @staticmethod
        def load_dataset(*a, **k):
            raise ConnectionError("no route to huggingface.co")

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    with pytest.raises(DataError, match="Offline"):
        bm.load_benchmark("humaneval", tmp_path)
    with pytest.raises(DataError, match="may\\s+not reach the hub"):
        load_hub_prompts(OmegaConf.create({"name": "mlabonne/open-perfectblend", "split": "train"}))
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match="pip install datasets"):
        load_hub_prompts(OmegaConf.create({"name": "mlabonne/open-perfectblend"}))


@needs_bench
def test_benchmark_prompts_are_dropped(tok):
    keys = bm.benchmark_prompt_keys(BENCH)
    flt = PromptFilter(tokenizer=tok, max_prompt_tokens=10_000, benchmark_keys=keys)
    gsm = bm.first_turns("gsm8k", BENCH)[3]
    bare_question = gsm[: -len(bm.MATH_SUFFIX)]
    mbpp = bm.first_turns("mbpp", BENCH)[0]
    mt_second_turn = bm.load_benchmark("mt-bench", BENCH)[0][1]
    for text in (gsm, "  " + gsm.replace(" ", "\n  ") + " ", bare_question, mbpp, mt_second_turn):
        flt.seen.clear()  # each variant on its own (the whitespace variant is also a duplicate of the first)
        assert not flt.accept({"prompt": text}), text[:60]
    assert flt.stats.counts["benchmark"] == 5
    assert flt.accept({"prompt": "Write a poem about a lighthouse keeper and the sea."})


# ----------------------------------------------------------------------------------------------
# prompt sources and filters


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_counts_empty_and_malformed_lines_and_strict_is_fatal(tmp_path):
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            json.dumps({"turns": ["first prompt here", "a second turn"]}),
            "",
            "{not json",
            json.dumps({"turns": []}),
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hello there"},
                    ]
                }
            ),
            json.dumps(["a list, not an object"]),
            "   ",
            json.dumps({"conversations": [{"from": "human", "value": "sharegpt style"}]}),
        ],
    )
    rows = read_prompt_jsonl(path, strict=False, stats=(stats := PromptFilter(None, 10).stats))
    assert [r["prompt"] for r in rows] == ["first prompt here", "Hello there", "sharegpt style"]
    assert rows[1]["system"] == "Be brief."
    assert stats.counts["empty_line"] == 2 and stats.counts["malformed_line"] == 3
    assert stats.examples["malformed_line"] == [3, 4, 6]
    with pytest.raises(DataError, match=r"p.jsonl:2: empty line"):
        read_prompt_jsonl(path, strict=True)


def test_degenerate_repetition_filter():
    assert is_degenerate("ha " * 30)
    assert is_degenerate("Tell me more " * 8)
    assert is_degenerate("What??????????????????????????????????")
    assert is_degenerate("\n".join(["print the value now"] * 6))
    assert not is_degenerate(
        "Write a Python function that returns the n-th Fibonacci number using memoization."
    )
    assert not is_degenerate(
        "A train leaves at 3 pm going 60 mph; another leaves at 4 pm going 80 mph. When does "
        "the second catch up with the first?"
    )


def test_filter_drops_prompt_longer_than_max_length(tok):
    flt = PromptFilter(tokenizer=tok, max_prompt_tokens=64)
    assert flt.accept({"prompt": "What is the boiling point of water at sea level?"})
    assert not flt.accept(
        {"prompt": "Please sort these numbers: " + ", ".join(str(i * 7919 % 1000) for i in range(80))}
    )
    assert flt.stats.counts["too_long_tokens"] == 1 and flt.stats.examples["too_long_tokens"][0] > 64
    assert not flt.accept({"prompt": "what is the boiling point of water at  sea level?".capitalize()})
    assert flt.stats.counts["duplicate"] == 1
    assert not flt.accept({"prompt": "Hi"}) and flt.stats.counts["length_chars"] == 1


def test_split_is_deterministic_and_disjoint():
    recs = [{"id": str(i), "prompt": f"p{i}"} for i in range(100)]
    a_train, a_val = split_train_val(recs, 0.1, seed=0)
    b_train, b_val = split_train_val(list(recs), 0.1, seed=0)
    assert a_train == b_train and a_val == b_val and len(a_val) == 10
    assert {r["id"] for r in a_train} | {r["id"] for r in a_val} == {r["id"] for r in recs}
    assert not {r["id"] for r in a_train} & {r["id"] for r in a_val}
    assert split_train_val(recs, 0.1, seed=1)[1] != a_val
    assert len(split_train_val(recs[:3], 0.1, seed=0)[1]) == 1  # at least one validation prompt


def test_salvage_keeps_the_leading_question():
    from dspark.data.prompts import salvage_question

    assert salvage_question("How do I sort a list? I tried sorted() but it keeps") == "How do I sort a list?"
    assert salvage_question("What is 2+2? And 3+3?\nAlso, for extra credit, expl") == "What is 2+2? And 3+3?"
    assert salvage_question(" Is water wet?") == "Is water wet?"
    assert salvage_question("Write a function that computes the sum of") == ""


def test_magpie_prefix_stops_at_user_content(tok):
    text = tok.decode(magpie_prefix(tok, None))
    assert text.endswith("<|im_start|>user\n") and "<|im_start|>system" in text
    text = tok.decode(magpie_prefix(tok, "You are a math tutor."))
    assert "You are a math tutor.<|im_end|>" in text and text.endswith("<|im_start|>user\n")


def test_self_generation_filters_and_mixes_topics(tiny, tok, tmp_path, monkeypatch):
    """The generation itself is stubbed (a random tiny model writes no sensible prompts); what is tested is
    the Magpie plumbing: topic prefixes, unfinished/duplicate/degenerate drops, the count target."""
    texts = iter(
        [
            "What is 12 times 13?",
            "Write a function to sort a list.",
            "Tell me a joke about cats.",
            "What is 12 times 13?",
            "spam " * 40,
            "How do I bake bread at home?",
            "Solve x + 3 = 10 for x.",
            "Reverse a string in Python.",
            "What is the tallest mountain?",
        ]
        * 3
    )
    seen_prefixes = []

    def fake_generate(target, prefixes, sampling, on_result=None, **kw):
        seen_prefixes.extend(tok.decode(p) for p in prefixes)
        for j, _ in enumerate(prefixes):
            ids = tok(next(texts), add_special_tokens=False)["input_ids"]
            on_result(j, Continuation(ids, finished=j % 7 != 6))

    monkeypatch.setattr("dspark.data.regenerate.generate_continuations", fake_generate)
    cfg = data_cfg(tmp_path, num_prompts=5, **{"self_generated.batch_size": 4})
    flt = PromptFilter(tokenizer=tok, max_prompt_tokens=128)
    got = self_generate_prompts(tiny, cfg, flt)
    assert len(got) == 5 and len({g["prompt"] for g in got}) == 5
    assert flt.stats.counts["duplicate"] >= 1 and flt.stats.counts["repetitive"] >= 1
    assert flt.stats.counts["unfinished"] + flt.stats.counts["salvaged"] >= 1
    assert all(not g["prompt"].startswith("Solve") for g in got)  # cut without a question: dropped
    assert {g["domain"] for g in got} == {"math", "code", "chat"}
    assert any("math tutor" in p for p in seen_prefixes) and any(
        "Python programmer" in p for p in seen_prefixes
    )


# ----------------------------------------------------------------------------------------------
# chat templates and loss masks

# A Qwen3-like ChatML template with reasoning handling: the last assistant turn is rendered with a
# <think> block (empty in non-thinking mode), earlier turns lose theirs, and the generation prompt
# holds the empty block when enable_thinking is false. (No Qwen tokenizer is available offline.)
QWEN3_LIKE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set ns = namespace(content=m.content, reasoning='') -%}"
    "{%- if '</think>' in m.content -%}"
    "{%- set ns.reasoning = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set ns.content = m.content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + ns.reasoning + '\\n</think>\\n\\n' + ns.content "
    "+ '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + ns.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def masked_text(tokenizer, t) -> list[str]:
    """Decoded runs of consecutive masked tokens."""
    runs, cur = [], []
    for i, m in zip(t.input_ids, t.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tokenizer.decode(cur)), cur.clear()
    if cur:
        runs.append(tokenizer.decode(cur))
    return runs


CONV = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 equals 4. What is 2+2? It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "3+3 = 6."},
]


def test_chatml_mask_is_exactly_assistant_content_plus_end_marker(tok):
    markers = end_markers(tok, [0, 2])
    t = tokenize_conversation(tok, CONV, max_length=512, markers=markers)
    assert masked_text(tok, t) == ["2+2 equals 4. What is 2+2? It is 4.<|im_end|>", "3+3 = 6.<|im_end|>"]
    # The training sequence starts with exactly the tokens the target saw before answering.
    prompt = prompt_ids(tok, CONV[:1])
    assert t.input_ids[: len(prompt)] == prompt
    rendered = tok.apply_chat_template(CONV, tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert t.input_ids == list(rendered)


def test_qwen3_like_template_masks_answer_not_think_block(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", QWEN3_LIKE)
    kw = {"enable_thinking": False}
    assert tok.decode(prompt_ids(tok, CONV[:1], kw)).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    t = tokenize_conversation(tok, CONV[:2], max_length=512, chat_kwargs=kw, markers=["<|im_end|>"])
    assert masked_text(tok, t) == ["2+2 equals 4. What is 2+2? It is 4.<|im_end|>"]
    # Thinking mode: the reasoning the target wrote is its output too, and stays masked in the last turn;
    # an earlier turn's reasoning is dropped by the template and only its answer is found.
    thought = [
        {"role": "user", "content": "Add 2 and 2."},
        {"role": "assistant", "content": "<think>\n2 plus 2.\n</think>\n\nIt is 4."},
    ]
    t = tokenize_conversation(tok, thought, max_length=512, markers=["<|im_end|>"])
    assert masked_text(tok, t) == ["<think>\n2 plus 2.\n</think>\n\nIt is 4.<|im_end|>"]
    t = tokenize_conversation(tok, thought + CONV[2:], max_length=512, markers=["<|im_end|>"])
    assert masked_text(tok, t) == ["It is 4.<|im_end|>", "3+3 = 6.<|im_end|>"]


def gemma_tokenizer():
    from dspark.target import _gguf_cache_dir, default_cache_dir, resolve_source

    cfg = target_cfg("gemma3_270m")
    cache = default_cache_dir()
    if not (cache / "gguf" / cfg.gguf_file).exists():
        pytest.skip("Gemma-3-270M GGUF not assembled in the dspark cache (needs its 4 PyPI chunk packages)")
    _, where, gguf = resolve_source(cfg, cache)
    folder = _gguf_cache_dir(Path(where) / gguf, "tokenizer", cache)
    if not (folder / "tokenizer_config.json").exists():
        pytest.skip(
            "Gemma tokenizer not extracted yet (load_tokenizer_only on gemma3_270m takes ~1 min once)"
        )
    from dspark.target import load_tokenizer_only

    return load_tokenizer_only(cfg, cache)[1]


def test_gemma_template_mask():
    gtok = gemma_tokenizer()
    markers = end_markers(gtok, gtok.convert_tokens_to_ids(["<end_of_turn>", "<eos>"]))
    conv = [{"role": "system", "content": "Be terse."}] + CONV
    t = tokenize_conversation(gtok, conv, max_length=512, markers=markers)
    assert masked_text(gtok, t) == [
        "2+2 equals 4. What is 2+2? It is 4.<end_of_turn>",
        "3+3 = 6.<end_of_turn>",
    ]
    prompt = prompt_ids(gtok, conv[:2])
    assert t.input_ids[: len(prompt)] == prompt and t.input_ids[0] == gtok.bos_token_id


def test_template_without_assistant_spans_raises(tok, monkeypatch):
    monkeypatch.setattr(
        tok,
        "chat_template",
        "{% for m in messages %}{% if m.role == 'user' %}"
        "<|im_start|>user\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}",
    )
    with pytest.raises(TemplateError, match="does not render assistant message 1 verbatim"):
        tokenize_conversation(tok, CONV[:2], max_length=512)
    monkeypatch.setattr(
        tok, "chat_template", "{% for m in messages %}{{ m.role }}: {{ m.content | upper }}\n{% endfor %}"
    )
    with pytest.raises(TemplateError):
        tokenize_conversation(tok, CONV[:2], max_length=512)


def test_truncation_policy_and_unfinished_answers(tok):
    long_answer = " ".join(f"word{i}" for i in range(300))
    conv = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": long_answer}]
    t = tokenize_conversation(tok, conv, max_length=64, markers=["<|im_end|>"])
    assert len(t.input_ids) == 64 and t.truncated and t.loss_mask[-1]
    # A prompt that fills max_length leaves no assistant token: the sample is dropped (None).
    assert tokenize_conversation(tok, conv, max_length=len(prompt_ids(tok, conv[:1]))) is None
    # An answer cut at max_new_tokens ends at its last content token (no end marker it never wrote).
    t = tokenize_conversation(tok, CONV[:2], max_length=512, markers=["<|im_end|>"], complete=False)
    assert masked_text(tok, t) == ["2+2 equals 4. What is 2+2? It is 4."] and t.loss_mask[-1]


# ----------------------------------------------------------------------------------------------
# generation


def test_nucleus_fast_path_matches_full_sort():
    torch.manual_seed(0)
    # Peaked rows (nucleus inside the top 512) and flat rows (it is not): both must match a full sort.
    logits = torch.cat([torch.randn(4, 4096) * 8, torch.randn(4, 4096) * 0.1])
    probs = torch.softmax(logits, -1)
    for top_k, top_p in [(0, 0.9), (0, 0.99), (50, 0.8), (1000, 0.95), (0, 1.0)]:
        w, ids = nucleus(probs, top_k, top_p)
        fast = torch.zeros_like(probs).scatter_add(1, ids, w)
        srt, order = probs.sort(-1, descending=True)
        if top_k:
            srt, order = srt[:, :top_k], order[:, :top_k]
        d = srt / srt.sum(-1, keepdim=True)
        keep = (d.cumsum(-1) - d) < top_p
        ref = torch.zeros_like(probs).scatter_add(1, order, srt * keep)
        torch.testing.assert_close(fast / fast.sum(-1, keepdim=True), ref / ref.sum(-1, keepdim=True))


def test_decode_loop_matches_hf_generate_greedy(tiny, tok):
    prompts = ["Hi", "What is the capital of France?", "Write a poem."]
    pre = [prompt_ids(tok, [{"role": "user", "content": p}]) for p in prompts]
    s = Sampling(temperature=0.0, max_new_tokens=12)
    ref = generate_continuations(tiny, pre, s, batch_size=3, seed=0, backend="hf")
    # batch_size 2 < 3 prompts: the third joins the running batch (cache merge with left padding).
    for bs in (3, 2):
        got = generate_continuations(tiny, pre, s, batch_size=bs, seed=0, backend="loop")
        assert [c.tokens for c in got] == [c.tokens for c in ref]
    assert tiny.model.config._attn_implementation == "sdpa"  # the decoding attention was switched back
    # Sampling is reproducible from the seed alone and changes with it.
    s = Sampling(temperature=1.0, top_p=0.9, max_new_tokens=8)
    x = generate_continuations(tiny, pre, s, batch_size=2, seed=1)
    assert [c.tokens for c in x] == [
        c.tokens for c in generate_continuations(tiny, pre, s, batch_size=2, seed=1)
    ]
    assert [c.tokens for c in x] != [
        c.tokens for c in generate_continuations(tiny, pre, s, batch_size=2, seed=2)
    ]


def test_decode_loop_drops_finished_rows(tiny, tok, monkeypatch):
    """A row that stops leaves the batch; the others go on with a consistent cache."""
    eos = tiny.eos_token_ids[0]
    pre = [prompt_ids(tok, [{"role": "user", "content": p}]) for p in ("a b c", "d e f g", "h")]
    s = Sampling(temperature=0.0, max_new_tokens=10)
    ref = generate_continuations(tiny, pre, s, batch_size=3, seed=0)
    calls = {"n": 0}
    real = __import__("dspark.data.regenerate", fromlist=["sample_next"]).sample_next

    def stop_row_once(logits, sampling, gen):  # force one row to emit eos at step 3
        out = real(logits, sampling, gen)
        calls["n"] += 1
        if calls["n"] == 3:
            out[0] = eos
        return out

    monkeypatch.setattr("dspark.data.regenerate.sample_next", stop_row_once)
    got = generate_continuations(tiny, pre, s, batch_size=3, seed=0)
    stopped = [i for i, c in enumerate(got) if c.finished]
    assert len(stopped) == 1 and len(got[stopped[0]].tokens) == 2
    for i in range(3):
        if i not in stopped:
            assert got[i].tokens == ref[i].tokens and not got[i].finished


PROMPTS = [
    {"id": f"p{i}", "prompt": f"Question number {i}: what is {i} plus {i}?", "domain": "math"}
    for i in range(6)
]


def regen(tiny, out_dir, prompts=PROMPTS, sampling=None, **kw):
    """One split through ``regenerate``; its stats."""
    sampling = sampling or Sampling(1.0, 1.0, 0, 6)
    per_split, _ = regenerate(
        tiny, {"train": prompts}, out_dir, sampling, shard_size=2, batch_size=2, seed=0, max_length=256, **kw
    )
    return per_split["train"]


class Interrupt(Exception):
    pass


def test_regeneration_resumes_without_duplicates(tiny, tmp_path):
    full = tmp_path / "full"
    regen(tiny, full)
    calls = {"n": 0}

    def write_then_die(path, rows):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Interrupt  # the process dies after the first shard
        atomic_write_jsonl(path, rows)

    part = tmp_path / "part"
    with pytest.raises(Interrupt):
        regen(tiny, part, write_rows=write_then_die)
    assert sorted(p.name for p in part.iterdir()) == ["train-00000.jsonl"]
    first = (part / "train-00000.jsonl").read_bytes()
    stats = regen(tiny, part)
    assert stats.skipped_shards == 1 and stats.written_shards == 2 and stats.conversations == 4
    assert (part / "train-00000.jsonl").read_bytes() == first  # the finished shard was not redone
    rows = load_conversations(part, "train")
    assert [r["id"] for r in rows] == [p["id"] for p in PROMPTS]  # each sample exactly once, in order
    assert [r["id"] for r in rows] == [r["id"] for r in load_conversations(full, "train")]
    assert rows[0]["messages"][-1]["role"] == "assistant" and rows[0]["finish"] in ("stop", "length")
    # A shard from another prompt list is refused rather than mixed in.
    with pytest.raises(DataError, match="refusing to mix"):
        regen(tiny, part, prompts=PROMPTS[::-1], sampling=Sampling())


def test_failing_write_leaves_no_half_written_shard(tiny, tmp_path):
    def full_disk(path, rows):
        def rows_then_enospc():
            yield rows[0]
            raise OSError(errno.ENOSPC, "No space left on device")

        atomic_write_jsonl(path, rows_then_enospc())

    with pytest.raises(OSError, match="No space left"):
        regen(tiny, tmp_path, write_rows=full_disk)
    assert list(tmp_path.iterdir()) == []  # neither the shard nor its temp file
    assert regen(tiny, tmp_path).written_shards == 3


def test_atomic_open_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_open(path) as f:
        f.write("half")
        raise RuntimeError
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.json"]


# ----------------------------------------------------------------------------------------------
# prepare / ensure_dataset


def test_prepare_jsonl_end_to_end_and_reuse(tiny, tmp_path, monkeypatch):
    from dspark.data.datamodule import tokens_path
    from dspark.data.dataset import ensure_dataset, prepare_dataset, read_done
    from dspark.data.tokenize import load_tokens

    lines = [json.dumps({"turns": [f"Tell me fact number {i} about the ocean."]}) for i in range(10)]
    src = write_lines(tmp_path / "src.jsonl", lines + ["", "{broken"])
    cfg = data_cfg(
        tmp_path / "ds",
        source="jsonl",
        num_prompts=8,
        max_new_tokens=6,
        shard_size=4,
        **{"jsonl.path": str(src)},
    )
    out = prepare_dataset(cfg, target_cfg("tiny"), target=tiny)
    done = read_done(out)
    counts = done["counts"]
    assert counts["conversations"] == 8 and counts["prompts"]["train"] == 7 and counts["prompts"]["val"] == 1
    assert (
        counts["prompts"]["counts"]["malformed_line"] == 1 and counts["prompts"]["counts"]["empty_line"] == 1
    )
    assert done["rate"]["conversations_per_min"] > 0 and done["config"]["data"]["num_prompts"] == 8
    train = load_tokens(tokens_path(out, "train"))
    assert len(train) == 7 and train.meta["pad_token_id"] == tok_pad(tiny)
    assert all(train.sample(i)[1].any() for i in range(len(train)))

    # A finished folder is reused without loading anything...
    never = lambda cfg: pytest.fail("should not load the target")  # noqa: E731
    monkeypatch.setattr("dspark.data.dataset._load_target", never)
    assert ensure_dataset(cfg, target_cfg("tiny")) == out
    # Keys that only change how the folder is read or built are free to differ...
    read_only = OmegaConf.merge(cfg, {"batch_size": 7, "gen_batch_size": 3, "anchors_per_sequence": 5})
    assert ensure_dataset(read_only, target_cfg("tiny")) == out
    # ...and a different data config for the same folder is refused with the differing key named.
    cfg.num_prompts = 9
    with pytest.raises(DataError, match="num_prompts: 8 -> 9"):
        ensure_dataset(cfg, target_cfg("tiny"))


def tok_pad(target) -> int:
    return int(target.tokenizer.pad_token_id)


def test_thread_governor_follows_the_load(monkeypatch):
    from dspark.data.regenerate import ThreadGovernor

    threads = torch.get_num_threads()
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr("os.getloadavg", lambda: (3.0, 3.0, 3.0))  # two other busy jobs
        gov = ThreadGovernor("auto", period=0.0)
        assert torch.get_num_threads() == 1
        monkeypatch.setattr("os.getloadavg", lambda: (1.0, 1.0, 1.0))  # only our own thread left
        gov.tick()
        assert torch.get_num_threads() == 2
        ThreadGovernor(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
