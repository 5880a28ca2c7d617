"""Benchmark prompt suites (evaluation only, never training data).

Local form: a folder of ``<name>.jsonl`` files, one ``{"turns": [...]}`` per line; the six DeepSpec
files ship inside the package (``PACKAGED_BENCHMARKS``, the configs' default). Hub form: the source
datasets, converted to the same turns with the same prompt wording, for machines that reach the
Hugging Face hub.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import DataError
from ..core.provenance import checkout_root
from .io import PACKAGE_SCHEME, normalize_text, resolve_path

# The DeepSpec prompt files shipped with dspark (README.md there: sources and licence).
PACKAGED_BENCHMARKS = "pkg://dspark/data/benchmark_prompts"

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
    """Rows of a turns-JSONL file: each line {"turns": [non-empty strings]} (DataError naming the
    line otherwise: a string for `turns` would read as one turn per character)."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text: save it as UTF-8") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["turns"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DataError(f"{path}:{n}: expected a JSON object with a 'turns' list ({err})") from None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DataError(f"{path}:{n}: 'turns' must be a non-empty list of strings, not {turns!r:.60}")
        if not turns[0].strip():
            raise DataError(f"{path}:{n}: the first turn is empty: give it a prompt or drop the line")
        rows.append(turns)
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
            f"{err.__class__.__name__}: {err}. Offline? Set benchmark_dir={PACKAGED_BENCHMARKS} (the six "
            f"suites shipped with dspark) or to a folder of turns-JSONL files."
        ) from err
    return [suite.to_turns(row) for row in ds]


def _not_a_folder(key: str, benchmark_dir: str | Path, folder: Path) -> str:
    text = str(benchmark_dir)
    if text.startswith(PACKAGE_SCHEME):
        where = f" ({folder})"
    elif Path(text).expanduser().is_absolute():
        where = ""
    else:
        places = [Path.cwd()] + ([checkout_root()] if checkout_root() else [])
        where = f" (looked under {' and '.join(map(str, places))})"
    return f"{key} '{benchmark_dir}' is not a folder{where}"


def benchmark_folder(benchmark_dir: str | Path) -> Path:
    """The folder a `benchmark_dir` setting names, or a one-line error saying how to fix it."""
    folder = resolve_path(benchmark_dir)
    if not folder.is_dir():
        raise DataError(
            f"{_not_a_folder('benchmark_dir', benchmark_dir, folder)}: point it at a folder of "
            f"<name>.jsonl turns files, or use {PACKAGED_BENCHMARKS} for the suites shipped with dspark"
        )
    return folder


def load_benchmark(
    name: str, benchmark_dir: str | Path | None = PACKAGED_BENCHMARKS, hub: bool = True
) -> list[list[str]]:
    """Turns of every row of a suite: from `benchmark_dir/<name>.jsonl` when present, else the hub
    (benchmark_dir=None: the hub only)."""
    if benchmark_dir is not None:
        path = benchmark_folder(benchmark_dir) / f"{name}.jsonl"
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
    return sorted(p.stem for p in benchmark_folder(benchmark_dir).glob("*.jsonl"))


def first_turns(
    name: str, benchmark_dir: str | Path | None = PACKAGED_BENCHMARKS, max_prompts: int | None = None
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


def decontamination_folder(benchmark_dir: str | Path) -> Path:
    """The folder `data.benchmark_dir` names, or a one-line error saying how to fix it."""
    folder = resolve_path(benchmark_dir)
    if not folder.is_dir():
        raise DataError(
            f"{_not_a_folder('data.benchmark_dir', benchmark_dir, folder)}: training prompts must be "
            f"checked against the benchmarks. Point it at a folder of turns-JSONL files, use "
            f"{PACKAGED_BENCHMARKS} (the suites shipped with dspark), or set data.benchmark_dir=null to "
            f"skip decontamination (not recommended)."
        )
    return folder


def benchmark_prompt_keys(benchmark_dir: str | Path, names: Iterable[str] | None = None) -> set[str]:
    """Every turn of every local suite (all turns, not only the first: a later MT-Bench turn is still
    benchmark text)."""
    folder = decontamination_folder(benchmark_dir)
    keys: set[str] = set()
    for name in names or available_benchmarks(folder):
        for turns in load_benchmark(name, folder, hub=False):
            for turn in turns:
                keys |= decontamination_keys(turn)
    return keys
