"""A prepared dataset folder (what python -m dspark.prepare builds): prompts -> target answers ->
tokens (-> offline feature cache) in data.dir.

    data.dir/
      build.json             the config this folder is built for (a rerun with another one is refused)
      prompts/{train,val}.jsonl, prompts/stats.json
      answers/{train,val}-NNNNN.jsonl   resumable shards of regenerated conversations
      tokens/{train,val}.safetensors    input_ids + assistant loss mask (ragged, flat)
      cache/                 optional offline target features (manifest.json + shards)
      DONE.json              counts, rates, timings and config; written last

`ensure_dataset` is what training calls: it returns data.dir when DONE.json is there and builds
whatever is missing otherwise (so `python -m dspark.train` works on a fresh checkout).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..core.errors import DataError
from ..core.io import atomic_write_json, atomic_write_jsonl, read_json, read_jsonl, remove_temp_files
from ..core.lock import folder_lock
from .benchmarks import decontamination_folder
from .cache import MANIFEST, FeatureCache, build_cache, target_fingerprint
from .io import resolve_path

log = logging.getLogger(__name__)

DONE = "DONE.json"
BUILD = "build.json"
# The data keys that define a dataset. Anything else in `data` (training batch size, workers,
# bucketing, anchors, cache options, generation batch/engine/threads, tokenising processes...) changes
# only how a folder is built or read, so it may change between runs without a rebuild.
CONTENT_KEYS = (
    "source", "num_prompts", "val_fraction", "seed", "max_length", "max_prompt_length", "min_prompt_chars",
    "max_prompt_chars", "max_new_tokens", "benchmark_dir", "strict", "shard_size", "self_generated",
    "jsonl", "hub",
)  # fmt: skip


def build_key(cfg_data, cfg_target) -> dict:
    data = (
        OmegaConf.to_container(cfg_data, resolve=True) if isinstance(cfg_data, DictConfig) else dict(cfg_data)
    )
    return {
        "data": {k: data.get(k) for k in CONTENT_KEYS},
        "target": {
            "name": cfg_target.name,
            "generation": _plain(cfg_target.get("generation")),
            "chat_template_kwargs": _plain(cfg_target.get("chat_template_kwargs")),
        },
    }


def _plain(node):
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _diff(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}: {x!r} -> {y!r}")
    return out


def read_done(data_dir: str | Path) -> dict | None:
    path = Path(data_dir) / DONE
    return read_json(path) if path.exists() else None


def validation_prompts(data_dir: str | Path) -> list[str]:
    """The user turns of a prepared folder's validation split (never trained on, decontaminated
    against the benchmarks); a DataError when the folder has none."""
    path = Path(data_dir) / "prompts" / "val.jsonl"
    if not path.is_file():
        raise DataError(f"{data_dir} has no prompts/val.jsonl: not a data.dir python -m dspark.prepare built")
    return [str(r["prompt"]) for r in read_jsonl(path) if r.get("prompt")]


def _check_build(data_dir: Path, key: dict) -> None:
    path = data_dir / BUILD
    if path.exists():
        old = read_json(path)
        # Only the defining keys count (an older build.json may hold more).
        old = {"data": {k: old.get("data", {}).get(k) for k in CONTENT_KEYS}, "target": old.get("target")}
        diff = _diff(old, key)
        if diff:
            raise DataError(
                f"data.dir {data_dir} was prepared with another config ({'; '.join(diff[:6])}). "
                f"Use another data.dir, or rebuild it with python -m dspark.prepare force=true"
            )


def check_data_config(cfg_data) -> None:
    """Data settings and files that would otherwise fail only after the target has loaded."""
    if cfg_data.get("benchmark_dir"):
        decontamination_folder(cfg_data.benchmark_dir)
    if cfg_data.get("source") == "jsonl" and cfg_data.get("jsonl", {}).get("path"):
        from .prompts import prompt_lines

        prompt_lines(cfg_data.jsonl.path)  # there, and UTF-8


def extra_dirs(cfg_data) -> list[Path]:
    return [resolve_path(d) for d in cfg_data.get("extra_dirs") or []]


def check_extra_dirs(cfg_data, cfg_target, features: str = "online") -> None:
    """``data.extra_dirs``: finished folders (they are read, never built), each made for this
    target and none of them data.dir itself; online features only."""
    extras = extra_dirs(cfg_data)
    if extras and features != "online":
        raise DataError("data.extra_dirs joins training splits for features=online only: drop one of them")
    main = resolve_path(cfg_data.dir)
    for path in extras:
        if path == main or extras.count(path) > 1:
            raise DataError(f"data.extra_dirs names {path} twice (data.dir included): name each folder once")
        if read_done(path) is None:
            raise DataError(
                f"data.extra_dirs: {path} holds no finished dataset (no {DONE}): prepare it first "
                f"(python -m dspark.prepare data.dir={path} …) or unpack its pack there"
            )
        built_for = (read_json(path / BUILD) if (path / BUILD).exists() else {}).get("target", {}).get("name")
        if built_for != cfg_target.name:
            raise DataError(
                f"data.extra_dirs: {path} was prepared for target {built_for!r}, this run trains for "
                f"{cfg_target.name!r} (another tokenizer, other answers): drop it, or prepare one for "
                f"this target"
            )


def check_data_dir(cfg_data, cfg_target, refuse_busy: bool = True, features: str = "online") -> None:
    """Refuse a data.dir built for another config, or a bad data config, before any model loads;
    ``refuse_busy``: also one another process is building now (it holds the folder's lock)."""
    check_data_config(cfg_data)
    check_extra_dirs(cfg_data, cfg_target, features)
    data_dir = resolve_path(cfg_data.dir)
    _check_build(data_dir, build_key(cfg_data, cfg_target))
    if refuse_busy and data_dir.is_dir():
        with folder_lock(data_dir, "data.dir", shared=True):
            pass


def _load_target(cfg_target):
    from ..target import load_target

    return load_target(cfg_target)


def prepare_dataset(cfg_data, cfg_target, target=None, force: bool = False) -> Path:
    """Run every missing stage into data.dir (finished stages and answer shards are reused), holding
    the folder's lock: a second process building (or training from) it is refused."""
    import torch

    threads = torch.get_num_threads()
    try:
        with folder_lock(resolve_path(cfg_data.dir), "data.dir"):
            return _prepare(cfg_data, cfg_target, target, force)
    finally:  # generation may lower the thread count; the caller (train) gets its own back
        torch.set_num_threads(threads)


def _prepare(cfg_data, cfg_target, target, force: bool) -> Path:
    import torch

    from .generation import Sampling, engine_options
    from .prompts import build_prompts
    from .regenerate import load_conversations, regenerate
    from .tokenize import end_markers, save_tokens, tokenize_records

    t_start = time.perf_counter()
    data_dir = resolve_path(cfg_data.dir)
    if force:
        for sub in ("prompts", "answers", "tokens", "cache", DONE, BUILD):
            p = data_dir / sub
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    key = build_key(cfg_data, cfg_target)
    _check_build(data_dir, key)
    engine = engine_options(cfg_data)  # refuse a bad data.engine before loading the model
    for sub in ("", "prompts", "answers", "tokens"):
        remove_temp_files(data_dir / sub)  # what a killed writer left
    target = target if target is not None else _load_target(cfg_target)
    tok, chat_kwargs = target.tokenizer, target.chat_template_kwargs
    timings: dict[str, float] = {}
    governor = None
    if target.device.type == "cpu":
        from .generation import ThreadGovernor

        governor = ThreadGovernor(cfg_data.get("cpu_threads", "auto"))
        log.info(
            "CPU generation with %d torch thread(s) (data.cpu_threads=%s)",
            torch.get_num_threads(),
            cfg_data.get("cpu_threads", "auto"),
        )
    on_step = governor.tick if governor else None

    # 1. prompts (all or nothing: stats.json is written last)
    pdir = data_dir / "prompts"
    t = time.perf_counter()
    if (pdir / "stats.json").exists():
        if not (data_dir / BUILD).exists():
            atomic_write_json(data_dir / BUILD, key)
        splits = {s: read_jsonl(pdir / f"{s}.jsonl") for s in ("train", "val")}
        prompt_stats = read_json(pdir / "stats.json")
        prompt_gen = {"reused": True}
    else:
        train, val, stats = build_prompts(
            cfg_data, tok, target=target, chat_kwargs=chat_kwargs, on_step=on_step
        )
        splits = {"train": train, "val": val}
        # The folder is bound to this config from its first file on (not before: a config that fails
        # before any prompt exists must not lock the folder to itself).
        atomic_write_json(data_dir / BUILD, key)
        for s, rows in splits.items():
            atomic_write_jsonl(pdir / f"{s}.jsonl", rows)
        prompt_stats = stats.as_dict() | {"train": len(train), "val": len(val)}
        atomic_write_json(pdir / "stats.json", prompt_stats)
        prompt_gen = dict(stats.generation)
    timings["prompts_s"] = time.perf_counter() - t

    # 2. answers (resumable shards)
    sampling = Sampling.from_config(cfg_target.get("generation"), cfg_data.get("max_new_tokens"))
    t = time.perf_counter()
    per_split, regen_total = regenerate(
        target,
        splits,
        data_dir / "answers",
        sampling,
        shard_size=int(cfg_data.get("shard_size", 64)),
        batch_size=int(cfg_data.get("gen_batch_size", 16)),
        seed=int(cfg_data.seed),
        max_length=int(cfg_data.max_length),
        chat_kwargs=chat_kwargs,
        on_step=on_step,
        **engine,
    )
    regen = {s: st.as_dict() for s, st in per_split.items()} | {"total": regen_total.as_dict()}
    timings["answers_s"] = time.perf_counter() - t

    # 3. tokens
    t = time.perf_counter()
    token_stats = {}
    markers = end_markers(tok, target.eos_token_ids)
    for s in splits:
        convs = load_conversations(data_dir / "answers", s)
        ids, samples, st = tokenize_records(
            tok,
            convs,
            max_length=int(cfg_data.max_length),
            chat_kwargs=chat_kwargs,
            markers=markers,
            desc=f"tokenising ({s})",
            workers=cfg_data.get("tokenize_workers", "auto"),
        )
        if not samples and (s == "train" or convs):
            raise DataError(
                f"no {s} conversation kept an assistant token after tokenisation ({st.as_dict()})"
            )
        meta = {
            "pad_token_id": int(
                tok.pad_token_id if tok.pad_token_id is not None else target.eos_token_ids[0]
            ),
            "max_length": int(cfg_data.max_length),
            "target": cfg_target.name,
            "end_markers": markers,
        }
        save_tokens(data_dir / "tokens" / f"{s}.safetensors", ids, samples, meta)
        token_stats[s] = st.as_dict()
    timings["tokenize_s"] = time.perf_counter() - t

    # 4. offline cache
    if cfg_data.get("offline_cache", False):
        t = time.perf_counter()
        build_offline_cache(cfg_data, target, data_dir)
        timings["cache_s"] = time.perf_counter() - t

    timings["total_s"] = time.perf_counter() - t_start
    convs = sum(token_stats[s]["samples"] for s in token_stats)
    gen_s = timings["prompts_s"] + timings["answers_s"]
    answer_tokens = regen_total.answer_tokens
    done = {
        "complete": True,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "target": target.describe(),
        "counts": {"prompts": prompt_stats, "answers": regen, "tokens": token_stats, "conversations": convs},
        "timings": {k: round(v, 2) for k, v in timings.items()},
        # Rates of this run (a resumed run counts only what it generated itself).
        "rate": {
            "conversations_per_min": round(60 * regen_total.conversations / gen_s, 2) if gen_s else None,
            "answer_tokens_per_s": round(answer_tokens / timings["answers_s"], 2)
            if timings["answers_s"]
            else None,
        },
        # How this run decoded: engine, concurrency and wall time of each phase.
        "generation": {
            "prompts": prompt_gen | {"seconds": round(timings["prompts_s"], 2)},
            "answers": {
                "engine": regen_total.engine,
                "compile": engine["compile"] and regen_total.engine == "fast",
                "concurrency": regen_total.concurrency,
                "seconds": round(timings["answers_s"], 2),
                "conversations": regen_total.conversations,
                "answer_tokens": answer_tokens,
                "rounds": regen_total.rounds,  # device- or host-paced (generation.round_times)
            },
        },
        "offline_cache": bool(cfg_data.get("offline_cache", False)),
        "device": str(target.device),
        "cpu_threads": torch.get_num_threads() if governor else None,
        "config": key,
    }
    atomic_write_json(data_dir / DONE, done)
    log.info(
        "dataset ready at %s: %d conversations (train %d / val %d) in %.0fs; %s",
        data_dir,
        convs,
        token_stats["train"]["samples"],
        token_stats["val"]["samples"],
        timings["total_s"],
        done["rate"],
    )
    return data_dir


def build_offline_cache(cfg_data, target, data_dir: Path) -> dict:
    from .datamodule import tokens_path
    from .tokenize import load_tokens

    splits = {s: load_tokens(tokens_path(data_dir, s)) for s in ("train", "val")}
    return build_cache(
        target,
        splits,
        data_dir / "cache",
        batch_size=int(cfg_data.get("cache_batch_size", 8)),
        shard_size=int(cfg_data.get("cache_shard_size", 64)),
        max_gb=float(cfg_data.get("cache_max_gb", 20)),
    )


def ensure_dataset(cfg_data, cfg_target, target=None, features: str | None = None) -> Path:
    """data.dir, prepared if needed. With features="offline" (or data.offline_cache) the feature cache
    is built too when missing; a cache for another target is refused, never silently replaced."""
    data_dir = resolve_path(cfg_data.dir)
    need_cache = features == "offline" or (features is None and bool(cfg_data.get("offline_cache", False)))
    if read_done(data_dir) is None:
        log.info("no finished dataset at %s: preparing it (python -m dspark.prepare does the same)", data_dir)
        prepare_dataset(cfg_data, cfg_target, target=target)  # loads the target once it holds the folder
    else:
        _check_build(data_dir, build_key(cfg_data, cfg_target))
    made_by = read_done(data_dir)["target"].get("fingerprint")
    for path in extra_dirs(cfg_data):
        theirs = read_done(path)["target"].get("fingerprint")
        if theirs != made_by:  # the same target's answers, from another copy or dtype of it
            log.warning("data.extra_dirs: %s was generated by %s, data.dir by %s", path, theirs, made_by)
    if need_cache:
        if not _cache_complete(data_dir):
            target = target if target is not None else _load_target(cfg_target)
            with folder_lock(data_dir, "data.dir"):
                build_offline_cache(cfg_data, target, data_dir)
        elif target is not None:
            FeatureCache(data_dir / "cache", "train", target_fingerprint(target))  # refuses a mismatch now
    return data_dir


def wait_for_dataset(cfg_data, features: str, timeout_s: float = 6 * 3600) -> None:
    """Ranks other than 0 wait until rank 0 has prepared data.dir (and its feature cache with
    features=offline); for several nodes data.dir must be on a shared disk, or prepared beforehand."""
    data_dir = resolve_path(cfg_data.dir)
    start = time.monotonic()
    while read_done(data_dir) is None or (features == "offline" and not _cache_complete(data_dir)):
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"no finished dataset at {data_dir} after {timeout_s:.0f} s (rank 0 makes it)")
        time.sleep(5)


def _cache_complete(data_dir: Path) -> bool:
    manifest = data_dir / "cache" / MANIFEST
    return manifest.exists() and bool(read_json(manifest).get("complete"))
