"""A batch of drafters trained for equal minutes on one dataset and evaluated alike: the logic of
``scripts/h200_table1.sh``, kept here so it is tested.

    python -m dspark.bench.batch split SPEC [SPEC …]
        one line per spec, ``NAME<TAB>OVERRIDES``; SPEC = ``NAME:OVERRIDES`` (the train overrides of
        that drafter, space-separated), e.g. ``DSpark-Markov:drafter=dspark head=markov``
    python -m dspark.bench.batch eval-args DRAFTER_DIR [CALIBRATION_FILE]
        the evaluate overrides this drafter needs: ``engine=fast`` when it runs on static caches
        (else ``engine=plain``), and for a drafter with a confidence head ``calibrate=true`` with the
        held-out prompts of CALIBRATION_FILE (Figs. 5 / 6)
    python -m dspark.bench.batch calibration-prompts DATA_DIR OUT.jsonl [N] [SKIP]
        the held-out prompts STS is fitted on, as a turns-JSONL file: the first N (60) validation
        prompts of a prepared data.dir; with SKIP (the prompts per benchmark that evaluation
        reports: it reads each suite's first ones), also N prompts of each packaged suite past its
        first SKIP, where it has them (GSM8K, MATH500, HumanEval, MBPP; AIME25's 30 and MT-Bench's
        80 are all reported), so the temperatures are fitted on the math and code the benchmark
        rounds hold, not on chat alone. None of them is ever reported, so calibrating a drafter
        leaves its reported prompts those of the drafters without a confidence head (with
        ``calibration.prompts`` evaluate would hold out the last prompts of each benchmark instead,
        and the rows of Table 1 would differ on AIME25 and MT-Bench, whose sets are small).

Every mistake exits with ``dspark: error: …`` and status 2.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ConfigError
from ..data.benchmarks import PACKAGED_BENCHMARKS, available_benchmarks, first_turns

# A name becomes a folder (outputs/h200/<name>, eval_<name>_t<T>) and a Table 1 row label.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# What the batch sets for every drafter alike (the same data, target, budget and folders): a spec
# that changed one would not be the same experiment. The training seed is not among them: a second
# seed of one recipe (``DSpark-S1:drafter=dspark seed=1``) is how a batch measures the spread between
# two trainings that no paired standard error over prompts counts.
OWNED = ("trainer.max_time", "trainer.max_steps", "hydra.", "out_dir", "data", "target")
OVERRIDE = re.compile(r"[+~]{0,2}[A-Za-z_][\w.@/-]*=.*")


@dataclass(frozen=True)
class BatchEntry:
    name: str
    overrides: tuple[str, ...]


def _owned(override: str) -> str | None:
    key = override.lstrip("+~").split("=", 1)[0]
    for prefix in OWNED:
        if key == prefix.rstrip(".") or key.startswith(prefix if prefix.endswith(".") else prefix + "."):
            return prefix.rstrip(".")
    return None


def parse_entry(text: str) -> BatchEntry:
    """``NAME:OVERRIDES`` -> BatchEntry (ConfigError naming the spec and the fix)."""
    name, sep, rest = text.partition(":")
    if not sep or not NAME.fullmatch(name):
        raise ConfigError(
            f"drafter spec {text!r}: write NAME:OVERRIDES, e.g. 'DFlash:drafter=dflash' (NAME: letters, "
            f"digits, . _ -)"
        )
    try:
        overrides = tuple(shlex.split(rest))
    except ValueError as err:
        raise ConfigError(f"drafter spec {text!r}: {err}") from None
    if not overrides:
        raise ConfigError(f"drafter spec {text!r} has no overrides: name the drafter, {name}:drafter=dflash")
    for o in overrides:
        if not OVERRIDE.fullmatch(o):
            raise ConfigError(f"drafter spec {text!r}: {o!r} is not a key=value override")
        if any(c.isspace() for c in o):  # the script passes overrides on as words
            raise ConfigError(f"drafter spec {text!r}: {o!r} holds a space, which the script cannot pass on")
        if (key := _owned(o)) is not None:
            raise ConfigError(
                f"drafter spec {text!r} sets {key}: the batch sets it for every drafter alike (same data, "
                f"target and minutes); leave it out"
            )
    return BatchEntry(name, overrides)


def parse_batch(texts: Sequence[str]) -> list[BatchEntry]:
    """Every spec parsed; the names unique (each is a run folder and a table row)."""
    if not texts:
        raise ConfigError("no drafter spec: e.g. 'DFlash:drafter=dflash' 'DSpark:drafter=dspark head=markov'")
    entries = [parse_entry(t) for t in texts]
    seen = set()
    for e in entries:
        if e.name.lower() in seen:  # folders on a case-insensitive disk would collide too
            raise ConfigError(f"two drafter specs are named {e.name}: give each its own name")
        seen.add(e.name.lower())
    return entries


def eval_overrides(drafter_dir: str | Path, calibration_file: str | None = None) -> list[str]:
    """The evaluate overrides the drafter in ``drafter_dir`` needs (read from its config, no weights)."""
    from ..checkpoints import read_drafter_spec

    spec = read_drafter_spec(drafter_dir)
    out = [f"engine={'fast' if spec.supports_static_cache else 'plain'}"]
    if spec.has_confidence and calibration_file:
        out += ["calibrate=true", f"calibration.file={calibration_file}"]
    return out


def write_calibration_prompts(
    data_dir: str | Path, out: str | Path, n: int = 60, skip: int | None = None,
    benchmark_dir: str | Path = PACKAGED_BENCHMARKS,
) -> Path:  # fmt: skip
    """The first ``n`` validation prompts of a prepared data.dir and, with ``skip``, ``n`` prompts
    of each suite in ``benchmark_dir`` past its first ``skip`` (the ones evaluation reports), as
    turns-JSONL (atomically)."""
    from ..core.io import atomic_write_jsonl
    from ..data.dataset import validation_prompts

    if n < 1:
        raise ConfigError(f"calibration prompts: N must be >= 1, got {n}")
    if skip is not None and skip < 0:
        raise ConfigError(f"calibration prompts: SKIP must be >= 0, got {skip}")
    prompts = validation_prompts(data_dir)[:n]
    if skip is not None:
        for name in available_benchmarks(benchmark_dir):
            prompts += first_turns(name, benchmark_dir)[skip : skip + n]
    atomic_write_jsonl(out, ({"turns": [p]} for p in prompts))
    return Path(out)


def main(argv: Sequence[str] | None = None) -> None:
    from ..cli import user_errors

    args = list(sys.argv[1:] if argv is None else argv)
    with user_errors():
        command = args.pop(0) if args else ""
        if command == "split":
            for e in parse_batch(args):
                print(f"{e.name}\t{' '.join(shlex.quote(o) for o in e.overrides)}")
        elif command == "eval-args" and len(args) in (1, 2):
            print(" ".join(eval_overrides(*args)))
        elif command == "calibration-prompts" and len(args) in (2, 3, 4):
            n = _count("N", args[2]) if len(args) > 2 else 60
            skip = _count("SKIP", args[3]) if len(args) > 3 else None
            print(write_calibration_prompts(args[0], args[1], n, skip))
        else:
            raise ConfigError(
                "usage: python -m dspark.bench.batch split SPEC… | eval-args DRAFTER_DIR "
                "[CALIBRATION_FILE] | calibration-prompts DATA_DIR OUT.jsonl [N] [SKIP]"
            )


def _count(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"calibration-prompts: {name} must be a number, got {value!r}") from None


if __name__ == "__main__":
    main()
