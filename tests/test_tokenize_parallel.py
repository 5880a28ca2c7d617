"""Tokenising in forked worker processes (data.tokenize_workers): the chunks come back in order and
the result is the serial one, ids, samples and stats alike; a platform or pool that cannot fork
falls back to the serial loop; a bad setting is refused before anything runs. Tiny target (seconds)."""

from __future__ import annotations

import os

import pytest
from conftest import CONF
from omegaconf import OmegaConf

from dspark.core.errors import ConfigError
from dspark.core.schema import check
from dspark.data import tokenize
from dspark.data.config import DataConfig
from dspark.data.tokenize import TemplateError, end_markers, tokenize_records, tokenize_workers

MAX_LENGTH = 96


def conversations(n: int = 300) -> list[dict]:
    """Answers of distinct lengths (record i has i + 1 words); every 3rd cut at max_new_tokens,
    every 25th behind a prompt that fills max_length (dropped); the long ones are truncated."""
    out = []
    for i in range(n):
        prompt = "long " * 200 if i % 25 == 7 else f"Question {i}: count to {i + 1}."
        answer = " ".join(f"w{j}" for j in range(i + 1))
        out.append(
            {
                "id": f"c{i:04d}",
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
                "finish": "length" if i % 3 == 2 else "stop",
            }
        )
    return out


@pytest.fixture(scope="module")
def tok(tiny_target):
    return tiny_target.tokenizer


@pytest.fixture(scope="module")
def markers(tok, tiny_target):
    return end_markers(tok, tiny_target.eos_token_ids)


def run(tok, markers, records, max_length=MAX_LENGTH, **kw):
    return tokenize_records(tok, records, max_length=max_length, markers=markers, **kw)


@pytest.fixture(scope="module")
def serial(tok, markers):
    return run(tok, markers, conversations(), workers=1)


def test_parallel_equals_serial(tok, markers, serial):
    env = os.environ.get("TOKENIZERS_PARALLELISM")
    ids, samples, stats = run(tok, markers, conversations(), workers=2, min_parallel=10)
    assert ids == serial[0]
    assert [(s.input_ids, s.loss_mask, s.truncated) for s in samples] == [
        (s.input_ids, s.loss_mask, s.truncated) for s in serial[1]
    ]
    assert stats == serial[2]
    # The set exercises every path: dropped, truncated and unfinished answers.
    assert stats.dropped_no_assistant_tokens == 12 and stats.truncated > 0
    assert stats.samples == len(ids) == 300 - 12
    assert os.environ.get("TOKENIZERS_PARALLELISM") == env  # set for the children only


def test_chunks_come_back_in_order(tok, markers):
    """Record i's sample is longer than record i - 1's (nothing truncated, dropped or cut), so any
    chunk joined out of place breaks the ascending lengths."""
    records = [r | {"finish": "stop"} for r in conversations(160) if "long" not in str(r["messages"])]
    ids, samples, _ = run(tok, markers, records, max_length=4096, workers=2, min_parallel=10)
    assert ids == [r["id"] for r in records]
    lengths = [len(s.input_ids) for s in samples]
    assert lengths == sorted(set(lengths)) and len(lengths) == len(records)


def test_small_sets_stay_serial(tok, markers, serial, monkeypatch):
    monkeypatch.setattr(tokenize, "_tokenize_parallel", lambda *a: pytest.fail("forked a pool"))
    assert run(tok, markers, conversations(), workers=2, min_parallel=301)[0] == serial[0]
    assert run(tok, markers, conversations(), workers=1, min_parallel=0)[0] == serial[0]


def test_no_fork_or_a_broken_pool_falls_back_to_serial(tok, markers, serial, monkeypatch, caplog):
    monkeypatch.setattr(tokenize.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    assert run(tok, markers, conversations(), workers=2, min_parallel=10) == serial
    assert "cannot fork" in caplog.text
    monkeypatch.undo()

    def no_pool(*args, **kwargs):
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(tokenize, "ProcessPoolExecutor", no_pool)
    assert run(tok, markers, conversations(), workers=2, min_parallel=10) == serial
    assert "parallel tokenisation failed" in caplog.text


def test_a_worker_error_is_raised_not_retried(tok, markers, monkeypatch):
    """A template that cannot be masked fails in the worker and reaches the caller as itself."""
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    monkeypatch.setattr(tokenize, "_tokenize_chunk", _no_serial(tokenize._tokenize_chunk))
    with pytest.raises(TemplateError):
        run(tok, markers, conversations(40), workers=2, min_parallel=10)


def _no_serial(chunk):
    """_tokenize_chunk for worker processes only: the parent must not rerun the set serially."""
    parent = os.getpid()

    def guarded(*args):
        assert os.getpid() != parent, "retried serially"
        return chunk(*args)

    return guarded


def test_worker_count():
    assert 1 <= tokenize_workers("auto") == tokenize_workers(None) <= tokenize.MAX_WORKERS
    assert tokenize_workers(1) == 1 and tokenize_workers(3) == 3


@pytest.mark.parametrize(
    "value,message",
    [
        (-3, "data.tokenize_workers=-3: must be >= 1"),
        (0, "data.tokenize_workers=0: must be >= 1"),
        ("many", "data.tokenize_workers='many': must be one of 'auto' or an integer >= 1"),
    ],
)
def test_bad_setting_is_a_config_error(value, message):
    cfg = OmegaConf.load(CONF / "data" / "quick.yaml")
    cfg.dir, cfg.tokenize_workers = "data", value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check(cfg, DataConfig, "data")
    cfg.tokenize_workers = "auto"
    assert check(cfg, DataConfig, "data").tokenize_workers == "auto"
