"""Data pipeline: prompt sources and filters, benchmarks, chat-template loss masks, decoding through
the engine (fast path == plain path), regeneration shards (resume, failing writes),
prepare/ensure_dataset. Runs on the tiny target (seconds)."""

from __future__ import annotations

import errno
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import BENCHMARKS, CONF
from omegaconf import OmegaConf

from dspark.core.errors import DataError
from dspark.core.io import atomic_open, atomic_write_json, atomic_write_jsonl, json_text
from dspark.data import benchmarks as bm
from dspark.data.generation import (
    Continuation,
    Sampling,
    engine_options,
    generate_continuations,
)
from dspark.data.prompts import (
    PromptFilter,
    is_degenerate,
    load_hub_prompts,
    magpie_prefix,
    read_prompt_jsonl,
    self_generate_prompts,
    split_train_val,
)
from dspark.data.regenerate import load_conversations, regenerate
from dspark.data.tokenize import (
    TemplateError,
    end_markers,
    prompt_ids,
    tokenize_conversation,
)


def target_cfg(name: str):
    cfg = OmegaConf.load(CONF / "target" / f"{name}.yaml")
    cfg.device = "cpu"
    return cfg


def data_cfg(tmp: Path, **over):
    cfg = OmegaConf.load(CONF / "data" / "quick.yaml")
    cfg.dir = str(tmp)
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


def test_benchmarks_load_by_name_and_domains():
    assert set(bm.DOMAINS) == {p.stem for p in BENCHMARKS.glob("*.jsonl")}
    assert (BENCHMARKS / "README.md").is_file()  # sources and licence travel with the files
    rows = {name: len(bm.load_benchmark(name, hub=False)) for name in bm.DOMAINS}  # the packaged default
    # the row counts of the README table
    assert rows == {
        "gsm8k": 1319,
        "math500": 500,
        "aime25": 30,
        "humaneval": 164,
        "mbpp": 257,
        "mt-bench": 80,
    }
    turns = bm.first_turns("gsm8k", BENCHMARKS)
    assert len(turns) == 1319 and turns[0].startswith("Janet")
    assert len(bm.first_turns("mt-bench", BENCHMARKS, max_prompts=5)) == 5
    assert len(bm.load_benchmark("mt-bench", BENCHMARKS)[0]) == 2  # all turns kept by load_benchmark


def test_benchmark_dir_of_ones_own_and_a_missing_one(tmp_path):
    (tmp_path / "mine.jsonl").write_text('{"turns": ["my own prompt", "and a follow-up"]}\n')
    assert bm.first_turns("mine", tmp_path) == ["my own prompt"]
    assert bm.available_benchmarks(tmp_path) == ["mine"]
    missing = f"benchmark_dir '.*nowhere' is not a folder.*use {bm.PACKAGED_BENCHMARKS}"
    with pytest.raises(DataError, match=missing):
        bm.first_turns("gsm8k", tmp_path / "nowhere")
    with pytest.raises(DataError, match="data.benchmark_dir '.*nowhere' is not a folder"):
        bm.benchmark_prompt_keys(tmp_path / "nowhere")


def test_a_missing_decontamination_folder_stops_prepare_before_the_target_loads(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "dspark.prepare", "target=tiny", f"data.dir={tmp_path / 'data'}",
         f"data.benchmark_dir={tmp_path / 'nowhere'}", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("dspark: error: data.benchmark_dir ") and "is not a folder" in run.stderr
    assert "loaded" not in run.stdout + run.stderr


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


def test_benchmark_prompts_are_dropped(tok):
    keys = bm.benchmark_prompt_keys(BENCHMARKS)
    flt = PromptFilter(tokenizer=tok, max_prompt_tokens=10_000, benchmark_keys=keys)
    gsm = bm.first_turns("gsm8k", BENCHMARKS)[3]
    bare_question = gsm[: -len(bm.MATH_SUFFIX)]
    mbpp = bm.first_turns("mbpp", BENCHMARKS)[0]
    mt_second_turn = bm.load_benchmark("mt-bench", BENCHMARKS)[0][1]
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

    monkeypatch.setattr("dspark.data.generation.generate_continuations", fake_generate)
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


def greedy_reference(target, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """Greedy decoding by full forwards (no cache): the independent reference."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(target.model(torch.tensor([seq])).logits[0, -1].argmax())
            if tok in eos:
                break
            out.append(tok)
            seq.append(tok)
    return out


def chat_prefixes(tok, n: int) -> list[list[int]]:
    words = ["rain", "a poem", "prime numbers", "the sea", "Paris", "sorting", "bread", "stars"]
    return [
        prompt_ids(tok, [{"role": "user", "content": f"Tell me {i} things about {words[i % 8]}."}])
        for i in range(n)
    ]


def test_greedy_continuations_match_full_forward(tiny, tok):
    pre = chat_prefixes(tok, 3)
    got = generate_continuations(
        tiny, pre, Sampling(temperature=0.0, max_new_tokens=12), batch_size=2, seed=0
    )
    eos = set(tiny.eos_token_ids)
    assert [c.tokens for c in got] == [greedy_reference(tiny, p, 12, eos) for p in pre]


@pytest.mark.parametrize(
    "sampling", [Sampling(0.0, 1.0, 0, 30), Sampling(0.8, 0.9, 0, 30), Sampling(1.0, 0.95, 30, 30)], ids=str
)
def test_fast_engine_regeneration_equals_plain(tiny, tok, sampling):
    """The fast engine's path (static caches, static top-p) and the plain engine's decode the same
    tokens, with more prompts than rows (continuous batching, rows leaving two at a time) and
    per-prompt limits; results stream through on_result in completion order."""
    pre = chat_prefixes(tok, 20)
    limits = [4 + (7 * i) % 24 for i in range(len(pre))]
    runs = {}
    for engine in ("plain", "fast"):
        order, report = [], {}
        got = generate_continuations(
            tiny, pre, sampling, batch_size=16, seed=[3, "x"], max_new_tokens=limits,
            on_result=lambda i, c, order=order: order.append(i), engine=engine, report=report,
        )  # fmt: skip
        assert sorted(order) == list(range(len(pre))) and order != sorted(order)
        assert report["engine"] == engine and report["concurrency"] == 16
        runs[engine] = got
    assert [c.tokens for c in runs["fast"]] == [c.tokens for c in runs["plain"]]
    assert [c.finished for c in runs["fast"]] == [c.finished for c in runs["plain"]]
    assert all(len(c.tokens) == m for c, m in zip(runs["plain"], limits) if not c.finished)
    # Reproducible from the seed alone, and it changes with it.
    if sampling.temperature > 0:
        again = generate_continuations(tiny, pre[:4], sampling, batch_size=2, seed=1)
        assert [c.tokens for c in again] == [
            c.tokens for c in generate_continuations(tiny, pre[:4], sampling, batch_size=2, seed=1)
        ]
        assert [c.tokens for c in again] != [
            c.tokens for c in generate_continuations(tiny, pre[:4], sampling, batch_size=2, seed=2)
        ]


def test_stop_token_ends_a_continuation(tiny, tok):
    """A continuation that samples a stop token is finished and excludes it; limits cut others."""
    pre = chat_prefixes(tok, 4)
    free = generate_continuations(tiny, pre, Sampling(0.0, max_new_tokens=10), batch_size=4, seed=0)
    stop = free[1].tokens[3]
    tiny.eos_token_ids.append(stop)
    try:
        got = generate_continuations(tiny, pre, Sampling(0.0, max_new_tokens=10), batch_size=4, seed=0)
    finally:
        tiny.eos_token_ids.remove(stop)
    for g, ref in zip(got, free):
        cut = ref.tokens.index(stop) if stop in ref.tokens else None
        assert g.tokens == ref.tokens[:cut] and g.finished == (cut is not None)
    assert got[1].finished


def test_engine_options_from_config(tmp_path):
    assert engine_options(data_cfg(tmp_path)) == {"engine": "auto", "compile": False}
    assert engine_options(data_cfg(tmp_path, engine="fast", engine_compile=True))["compile"]
    assert engine_options(data_cfg(tmp_path, generate_backend="loop"))["engine"] == "auto"  # the old default
    with pytest.raises(DataError, match="generate_backend=hf was removed"):
        engine_options(data_cfg(tmp_path, generate_backend="hf"))
    with pytest.raises(DataError, match="data.engine 'hf'"):
        engine_options(data_cfg(tmp_path, engine="hf"))


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


def test_json_files_keep_flat_lists_on_one_line(tmp_path):
    """What ``atomic_write_json`` writes reads back as ``json.dump`` would have written it, its
    nesting indented, a list of scalars a line (a per-round record: not a line per number)."""
    obj = {
        "a": [1, 2.5, None, "x", True],
        "nested": {"b": [[0.1, 0.2], [0.3]], "c": [{"d": 1}, [], {}], 3: float("nan"), None: Path("p")},
        "rounds": list(range(500)),
        "empty": [],
    }
    path = tmp_path / "x.json"
    atomic_write_json(path, obj)
    text = path.read_text()
    assert text.endswith("}\n") and json.loads(text) == json.loads(json.dumps(obj, default=str))
    assert '"rounds": [0, 1, 2' in text and '"b": [\n' in text and "[0.1, 0.2]" in text
    assert len(text.splitlines()) < 25
    assert json_text([]) == "[]" and json_text({}) == "{}" and json_text(1.5) == "1.5"
    with pytest.raises(TypeError):
        json_text({(1, 2): 0})


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
    answers = done["generation"]["answers"]
    assert answers["engine"] == "plain" and answers["concurrency"] == 8 and answers["answer_tokens"] > 0
    rounds = answers["rounds"]  # what paced the decode rounds (no device clock on the CPU)
    assert rounds["rounds"] > 0 and rounds["ms_per_round"] > 0 and rounds["host_ms_per_round"] > 0
    assert rounds["gpu_ms_per_round"] is None
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
    from dspark.data.generation import ThreadGovernor

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


# ----------------------------------------------------------------------------------------------
# data.extra_dirs: several prepared folders trained on at once


def token_split(convs: list[tuple[list[int], list[int]]], tag: str):
    """A TokenSplit of (prompt tokens, answer tokens) conversations, the answers trained."""
    from dspark.data.tokenize import TokenSplit

    ids = [t for p, a in convs for t in p + a]
    mask = [m for p, a in convs for m in [0] * len(p) + [1] * len(a)]
    offsets = torch.tensor([0] + [len(p) + len(a) for p, a in convs]).cumsum(0)
    names = [f"{tag}{i}" for i in range(len(convs))]
    return TokenSplit(
        torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.uint8), offsets, names, {}
    )


def test_join_splits_leaves_out_prompts_already_held_and_keeps_the_rest_intact():
    from dspark.data.union import join_splits, prompt_keys

    train = token_split([([1, 2], [3, 4]), ([5], [6])], "t")
    val = token_split([([7, 8], [9])], "v")
    # The same prompt with another answer is a duplicate (the key stops at the first trained token);
    # so is a validation prompt, and a prompt twice within one extra; [1] alone is a prompt of its own.
    extra = token_split(
        [([1, 2], [30, 31, 32]), ([7, 8], [10]), ([1], [2, 3]), ([11], [12]), ([11], [13])], "e"
    )
    more = token_split([([1], [4]), ([14, 15], [16])], "m")
    assert len(set(prompt_keys(extra))) == 4
    joined = join_splits(train, {"a": extra, "b": more}, held_out=val)
    expect = [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6], [0, 1]), ([1, 2, 3], [0, 1, 1]), ([11, 12], [0, 1]),
              ([14, 15, 16], [0, 0, 1])]  # fmt: skip
    assert len(joined) == len(expect) and joined.ids == ["t0", "t1", "a:e2", "a:e3", "b:m1"]
    for i, (ids, mask) in enumerate(expect):
        got_ids, got_mask = joined.sample(i)
        assert got_ids.tolist() == ids and got_mask.int().tolist() == mask
    assert join_splits(train, {}) is train


def test_extra_dirs_join_the_training_split_and_bad_ones_are_refused_before_training(tiny, tmp_path):
    from dspark.core.errors import ConfigError
    from dspark.core.schema import check
    from dspark.data.config import DataConfig
    from dspark.data.datamodule import DraftDataModule
    from dspark.data.dataset import check_data_dir, prepare_dataset

    def prepared(name: str, facts: range):
        lines = [json.dumps({"turns": [f"Tell me fact number {i} about the ocean."]}) for i in facts]
        src = write_lines(tmp_path / f"{name}.jsonl", lines)
        cfg = data_cfg(tmp_path / name, source="jsonl", num_prompts=len(lines), max_new_tokens=4,
                       val_fraction=0.25, **{"jsonl.path": str(src)})  # fmt: skip
        prepare_dataset(cfg, target_cfg("tiny"), target=tiny)
        return cfg

    main, other = prepared("main", range(8)), prepared("other", range(4, 12))  # facts 4-7 in both

    def loaded(cfg):
        data = DraftDataModule(cfg)
        data.setup()
        return data.datasets

    def facts(ds) -> list[int]:  # the fact each conversation asks about
        said = [tiny.tokenizer.decode(ds.tokens.sample(i)[0]) for i in range(len(ds))]
        return [int(re.search(r"fact number (\d+) ", text).group(1)) for text in said]

    cfg = OmegaConf.merge(main, {"extra_dirs": [other.dir]})
    check_data_dir(cfg, target_cfg("tiny"))
    alone, theirs, joined = loaded(main), loaded(other), loaded(cfg)
    # Main's conversations, then every one of the other folder's training split but those on facts 0-7
    # (main holds them all, in one split or the other); validation stays main's.
    new = [f for f in facts(theirs["train"]) if f >= 8]
    own = len(alone["train"])
    assert new and facts(joined["train"])[:own] == facts(alone["train"])
    assert sorted(facts(joined["train"])[own:]) == sorted(new)
    assert facts(joined["val"]) == facts(alone["val"])
    from dspark.data.union import main as describe_cli

    describe_cli([main.dir, other.dir, "--json", str(tmp_path / "union.json")])
    said = json.loads((tmp_path / "union.json").read_text())
    assert said["folders"][other.dir] == {"conversations": len(theirs["train"]), "joined": len(new)}
    assert said["train_conversations"] == len(joined["train"]) == own + len(new)

    def refused(error, match, features="online", **over):
        with pytest.raises(error, match=match):
            check_data_dir(OmegaConf.merge(main, over), target_cfg("tiny"), features=features)

    refused(DataError, "no finished dataset", extra_dirs=[str(tmp_path / "none")])
    refused(DataError, "twice", extra_dirs=[main.dir])
    refused(DataError, "features=online only", "offline", extra_dirs=[other.dir])
    build = tmp_path / "other" / "build.json"
    built = json.loads(build.read_text())
    built["target"]["name"] = "smollm2_135m"
    build.write_text(json.dumps(built))
    refused(DataError, "prepared for target 'smollm2_135m'", extra_dirs=[other.dir])
    with pytest.raises(ConfigError, match="extra_dirs"):
        check(OmegaConf.merge(cfg, {"offline_cache": True}), DataConfig, "data")
