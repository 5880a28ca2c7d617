"""Benchmark prompt suites (evaluation only, never training data).

Local form: a folder of ``<name>.jsonl`` files, one ``{"turns": [...]}`` per line (the DeepSpec
files under ``../shared/benchmarks``). Hub form: the source datasets, converted to the same turns
with the same prompt wording, for machines that reach the Hugging Face hub.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import DataError
from .io import normalize_text, resolve_path

DOMAINS = {
    "gsm8k": "math",
    "math500": "math",
    "aime25": "math",
    "humaneval": "code",
    "mbpp": "code",
    "mt-bench": "chat",
}

# The math suites append this instruction to every problem; decontamination also compares without it.
MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"


@dataclass(frozen=True)
class HubSuite:
    dataset: str
    config: str | None
    split: str
    to_turns: Callable[[dict], list[str]]


HUB_SUITES = {
    "gsm8k": HubSuite("openai/gsm8k", "main", "test", lambda r: [f"{r['question']}\n{MATH_SUFFIX}"]),
    "math500": HubSuite("HuggingFaceH4/MATH-500", None, "test", lambda r: [f"{r['problem']}\n{MATH_SUFFIX}"]),
    "aime25": HubSuite("MathArena/aime_2025", None, "train", lambda r: [f"{r['problem']}\n{MATH_SUFFIX}"]),
    "humaneval": HubSuite(
        "openai/openai_humaneval", None, "test", lambda r: [f"{CODE_PREFIX}{r['prompt']}\n```"]
    ),
    "mbpp": HubSuite("google-research-datasets/mbpp", "sanitized", "test", lambda r: [r["prompt"]]),
    "mt-bench": HubSuite("HuggingFaceH4/mt_bench_prompts", None, "train", lambda r: list(r["prompt"])),
}


def _read_turns_file(path: Path) -> list[list[str]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DataError(f"{path}:{n}: expected a JSON object with a 'turns' list ({err})") from None
            rows.append([str(t) for t in turns])
    return rows


def _load_from_hub(name: str) -> list[list[str]]:
    suite = HUB_SUITES[name]
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"benchmark '{name}' is not in the local benchmark folder and loading it from the hub needs the "
            f"'datasets' package: pip install datasets (or set benchmark_dir to a folder of "
            f"turns-JSONL files)"
        ) from None
    try:
        ds = datasets.load_dataset(suite.dataset, suite.config, split=suite.split)
    except Exception as err:  # the hub client raises many types for "offline"/"not found"
        raise DataError(
            f"could not load benchmark '{name}' ({suite.dataset}) from the Hugging Face hub: "
            f"{err.__class__.__name__}: {err}. Offline? Point benchmark_dir at a folder of turns-JSONL files "
            f"(e.g. ../shared/benchmarks)."
        ) from err
    return [suite.to_turns(row) for row in ds]


def load_benchmark(name: str, benchmark_dir: str | Path | None = None, hub: bool = True) -> list[list[str]]:
    """Turns of every row of a suite: from `benchmark_dir/<name>.jsonl` when present, else the hub."""
    if benchmark_dir is not None:
        folder = resolve_path(benchmark_dir)
        path = folder / f"{name}.jsonl"
        if path.exists():
            return _read_turns_file(path)
    if name not in HUB_SUITES:
        known = sorted(set(HUB_SUITES) | set(available_benchmarks(benchmark_dir)))
        raise DataError(
            f"unknown benchmark '{name}': not in {benchmark_dir} and not a hub suite; known: {known}"
        )
    if not hub:
        raise DataError(f"benchmark '{name}' is not in {benchmark_dir} and hub loading is off")
    return _load_from_hub(name)


def available_benchmarks(benchmark_dir: str | Path | None) -> list[str]:
    if benchmark_dir is None:
        return []
    folder = resolve_path(benchmark_dir)
    return sorted(p.stem for p in folder.glob("*.jsonl")) if folder.is_dir() else []


def first_turns(
    name: str, benchmark_dir: str | Path | None = None, max_prompts: int | None = None
) -> list[str]:
    """First user turn of each row (speculative-decoding evaluation uses the first turn only)."""
    rows = [turns[0] for turns in load_benchmark(name, benchmark_dir) if turns]
    return rows[:max_prompts] if max_prompts else rows


def decontamination_keys(text: str) -> set[str]:
    """Keys under which a prompt counts as 'equal' to a benchmark prompt: whitespace-normalised, with
    and without the math suffix, so the bare GSM8K question is caught too."""
    norm = normalize_text(text)
    keys = {norm}
    suffix = normalize_text(MATH_SUFFIX)
    if norm.endswith(suffix):
        keys.add(norm[: -len(suffix)].rstrip())
    return {k for k in keys if k}


def benchmark_prompt_keys(benchmark_dir: str | Path, names: Iterable[str] | None = None) -> set[str]:
    """Every turn of every local suite (all turns, not only the first: a later MT-Bench turn is still
    benchmark text)."""
    folder = resolve_path(benchmark_dir)
    if not folder.is_dir():
        raise DataError(
            f"data.benchmark_dir '{benchmark_dir}' is not a folder (looked under the working directory "
            f"and the project root): training prompts must be checked against the benchmarks. Point it "
            f"at a folder of "
            f"turns-JSONL files, or set data.benchmark_dir=null to skip decontamination (not recommended)."
        )
    keys: set[str] = set()
    for name in names or available_benchmarks(folder):
        for turns in load_benchmark(name, folder, hub=False):
            for turn in turns:
                keys |= decontamination_keys(turn)
    return keys
