"""A batch of drafters trained for equal minutes on one dataset and evaluated alike: the logic of
``scripts/h200_table1.sh``, kept here so it is tested.

    python -m dspark.bench.batch split SPEC [SPEC …]
        one line per spec, ``NAME<TAB>OVERRIDES``; SPEC = ``NAME:OVERRIDES`` (the train overrides of
        that drafter, space-separated), e.g. ``DSpark-Markov:drafter=dspark head=markov``
    python -m dspark.bench.batch eval-args DRAFTER_DIR [CALIBRATION_FILE]
        the evaluate overrides this drafter needs: ``engine=fast`` when it runs on static caches
        (else ``engine=plain``), and for a drafter with a confidence head ``calibrate=true`` with the
        held-out prompts of CALIBRATION_FILE (Figs. 5 / 6)
    python -m dspark.bench.batch calibration-prompts DATA_DIR OUT.jsonl [N]
        the first N (60) validation prompts of a prepared data.dir as a turns-JSONL file: the held-out
        prompts STS is fitted on. They are not benchmark prompts, so calibrating a drafter leaves its
        reported prompts the same as those of the drafters without a confidence head (with
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

# A name becomes a folder (outputs/h200/<name>, eval_<name>_t<T>) and a Table 1 row label.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# What the batch sets for every drafter alike (the same data, target, budget and folders): a spec
# that changed one would not be the same experiment.
OWNED = ("trainer.max_time", "trainer.max_steps", "hydra.", "out_dir", "data", "target", "seed")
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
                f"target, seed and minutes); leave it out"
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


def write_calibration_prompts(data_dir: str | Path, out: str | Path, n: int = 60) -> Path:
    """The first ``n`` validation prompts of a prepared data.dir as turns-JSONL (atomically)."""
    from ..core.io import atomic_write_jsonl
    from ..data.dataset import validation_prompts

    if n < 1:
        raise ConfigError(f"calibration prompts: N must be >= 1, got {n}")
    prompts = validation_prompts(data_dir)[:n]
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
        elif command == "calibration-prompts" and len(args) in (2, 3):
            try:
                n = int(args[2]) if len(args) == 3 else 60
            except ValueError:
                raise ConfigError(f"calibration-prompts: N must be a number, got {args[2]!r}") from None
            print(write_calibration_prompts(args[0], args[1], n))
        else:
            raise ConfigError(
                "usage: python -m dspark.bench.batch split SPEC… | eval-args DRAFTER_DIR "
                "[CALIBRATION_FILE] | calibration-prompts DATA_DIR OUT.jsonl [N]"
            )


if __name__ == "__main__":
    main()
