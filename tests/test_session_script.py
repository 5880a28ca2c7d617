"""scripts/h200_session.sh on the CPU: the compiler's cache packed into pieces and unpacked by a
later session's pipeline, and `wait` bringing the pieces back a few per call, each once, never one
still being written."""

from __future__ import annotations

import os
import subprocess

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "h200_session.sh"


def _session(cwd, *args, **env):
    # The project's environment is not on PATH: the pipeline's editable install fails fast and the run
    # goes on, as on a machine without the staged wheels.
    full = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), **{k: str(v) for k, v in env.items()}}
    proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_compile_cache_round_trip_and_pieces_sent_a_few_per_call(tmp_path):
    first, later = tmp_path / "first", tmp_path / "later"
    cache = first / "outputs/h200/compile_cache"
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "entry").write_bytes(os.urandom(31 << 20))  # incompressible: three 15 MiB pieces
    (cache / "triton.json").write_text('{"kernel": 1}')
    (first / "outputs/h200/session").mkdir(parents=True)

    _session(first, "pipeline", STAGES="cachekeep")
    pieces = sorted(p.name for p in (first / "outputs/h200/pack").iterdir() if not p.name.startswith("."))
    assert pieces == ["compile_cache.tar.xz.aa", "compile_cache.tar.xz.ab", "compile_cache.tar.xz.ac"]
    assert "cachekeep 0" in (first / "outputs/h200/session/stages.txt").read_text()
    assert not (first / "outputs/h200/pack.tmp").exists()
    # a piece still being written stays behind
    (first / "outputs/h200/pack.tmp").mkdir()
    (first / "outputs/h200/pack.tmp/drafter_x.tar.xz.aa").write_text("partial")

    sent = []
    for call in range(3):
        out = tmp_path / f"out{call}"
        _session(first, "wait", "0", OUT=out, PACK_PER_CALL=2)
        assert (out / "bundle.tgz").is_file()
        sent.append(sorted(p.name for p in out.iterdir() if p.name.startswith(("compile", "drafter"))))
    assert sent == [pieces[:2], pieces[2:], []]

    staged = tmp_path / "staged"
    staged.mkdir()
    for call in range(2):
        for piece in (tmp_path / f"out{call}").glob("compile_cache.tar.xz.*"):
            (staged / piece.name).write_bytes(piece.read_bytes())
    (later / "outputs/h200/session").mkdir(parents=True)
    _session(later, "pipeline", STAGES="", COMPILE_CACHE_PACK=staged / "compile_cache.tar.xz")
    restored = later / "outputs/h200/compile_cache"
    assert (restored / "fxgraph" / "entry").read_bytes() == (cache / "fxgraph" / "entry").read_bytes()
    assert (restored / "triton.json").read_text() == '{"kernel": 1}'
    assert "cache_restore 0" in (later / "outputs/h200/session/stages.txt").read_text()


def test_a_missing_cache_pack_leaves_the_stages_to_compile(tmp_path):
    (tmp_path / "outputs/h200/session").mkdir(parents=True)
    log = _session(tmp_path, "pipeline", STAGES="", COMPILE_CACHE_PACK=tmp_path / "nothing.tar.xz")
    assert "no compile cache restored" in log
    assert (tmp_path / "outputs/h200/session/done").is_file()


def test_wait_brings_back_the_curves_of_runs_still_training(tmp_path):
    h200 = tmp_path / "outputs/h200"
    (h200 / "session").mkdir(parents=True)
    running, resumed, done = h200 / "Running", h200 / "Running/logs/resumed-1000", h200 / "Done"
    resumed.mkdir(parents=True)
    (running / "logs/metrics.csv").write_text("step,val/tau_prob\n499,1.9\n")
    (resumed / "metrics.csv").write_text("step,val/tau_prob\n1499,2.4\n")
    (running / "config.yaml").write_text("seed: 0\n")
    (done / "logs").mkdir(parents=True)
    (done / "logs/metrics.csv").write_text("step\n")
    (done / "summary.json").write_text("{}")  # ended: collect brought its files back already

    out = tmp_path / "out"
    _session(tmp_path, "wait", "0", OUT=out)
    subprocess.run(["tar", "-xzf", str(out / "bundle.tgz"), "-C", str(out)], check=True)
    kept = out / "out/Running"
    names = sorted(p.name for p in kept.iterdir())
    assert names == ["config.yaml", "metrics_logs.csv", "metrics_resumed-1000.csv"]
    assert (kept / "metrics_resumed-1000.csv").read_text().endswith("1499,2.4\n")
    assert not (out / "out/Done").exists()


def test_batch_temperatures_are_checked_before_the_pipeline_starts(tmp_path):
    """``BATCH_TEMPERATURES`` (the batch stage's evaluations, "0 1" by default) takes 0 and 1 only:
    anything else is refused by ``start``, saying which, before a pipeline (and a machine's minutes)
    starts; a valid one starts it."""
    full = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "BATCH_TEMPERATURES": "0 2", "STAGES": ""}
    proc = subprocess.run(["bash", str(SCRIPT), "start"], cwd=tmp_path, env=full, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "BATCH_TEMPERATURES: '2' is not 0 or 1" in proc.stdout
    assert not (tmp_path / "outputs/h200/session").exists()  # nothing started
    assert "pipeline started" in _session(tmp_path, "start", BATCH_TEMPERATURES="0", STAGES="")
    _session(tmp_path, "wait", "30", OUT=tmp_path / "out")  # the empty pipeline ends
    assert (tmp_path / "outputs/h200/session/done").is_file()


def test_headlat_measures_the_part_of_the_grid_it_is_given(tmp_path):
    """``HEADLAT_BLOCKS`` / ``HEADLAT_FAMILIES``: a session measures the blocks another did not (its JSON
    joins the other's on the CPU); unset, the whole grid; ``HEADLAT_EXTRA``'s overrides pass through, each
    its own argument. ``python3`` stubbed: it records its arguments, the stage's orchestration is the
    script's own."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/bash\necho "$# $*" >> {calls}\n')  # the count, then the words
    (bin_dir / "python3").chmod(0o755)
    (tmp_path / "outputs/h200/session").mkdir(parents=True)
    path = f"{bin_dir}:/usr/bin:/bin"
    extra = "head.rank=32 drafter.num_layers=3"
    part = {"HEADLAT_BLOCKS": "10,16", "HEADLAT_FAMILIES": "rnn", "HEADLAT_EXTRA": extra}
    _session(tmp_path, "pipeline", STAGES="headlat", PATH=path, **part)
    _session(tmp_path, "pipeline", STAGES="headlat", PATH=path)
    runs = [c.split(" ", 1) for c in calls.read_text().splitlines()]
    bench = [words for _, words in runs if words.startswith("-m dspark.bench.head_latency")]
    counts = [int(n) for n, words in runs if words.startswith("-m dspark.bench.head_latency")]
    assert len(bench) == 2 and counts[0] == counts[1] + 2  # HEADLAT_EXTRA: two more arguments, not one
    assert "--families rnn --blocks 10,16 --rows 1,128" in bench[0]
    assert bench[0].endswith(f"head_latency.json {extra}")
    assert "--families dflash,markov,rnn --blocks 4,7,10,16 --rows 1,128" in bench[1]
    assert bench[1].endswith("head_latency.json")


def test_vocab_measures_the_named_drafter_or_each_of_a_batchs_runs(tmp_path):
    """The vocab stage: NAME's drafter into out/draft_vocab/; with ``VOCAB_RUNS`` each named run's into
    a folder of its own, a failing one not stopping the next. ``h200_draft_vocab.sh`` stubbed: it
    records the drafter and output folder it was given, and fails for a run without a drafter."""
    (tmp_path / "scripts").mkdir()
    stub = 'echo "$1 $OUT" >> calls.txt; test -d "$1"\n'
    (tmp_path / "scripts" / "h200_draft_vocab.sh").write_text(stub)
    for run in ("dspark", "R32", "R512"):
        (tmp_path / "outputs/h200" / run / "drafter").mkdir(parents=True)
    (tmp_path / "outputs/h200/session").mkdir(parents=True)
    _session(tmp_path, "pipeline", STAGES="vocab")
    _session(tmp_path, "pipeline", STAGES="vocab", VOCAB_RUNS="R32 gone R512")
    assert (tmp_path / "calls.txt").read_text().splitlines() == [
        "outputs/h200/dspark/drafter outputs/h200/out/draft_vocab",
        "outputs/h200/R32/drafter outputs/h200/out/draft_vocab/R32",
        "outputs/h200/gone/drafter outputs/h200/out/draft_vocab/gone",
        "outputs/h200/R512/drafter outputs/h200/out/draft_vocab/R512",
    ]
    stages = (tmp_path / "outputs/h200/session/stages.txt").read_text().splitlines()
    done = [" ".join(line.split()[:2]) for line in stages]  # both pipelines' stages, in order
    assert done == ["vocab 0", "vocab:R32 0", "vocab:gone 1", "vocab:R512 0"]


def test_keep_packs_each_of_a_batchs_runs_and_goes_on_past_a_missing_one(tmp_path):
    """``KEEP_RUNS``: every named run's drafter comes back in pieces of its own name; a run that is not
    there fails its own stage and the next is still kept; unpacked, a piece set is its drafter folder."""
    for name in ("A", "B"):
        drafter = tmp_path / "outputs/h200" / name / "drafter"
        drafter.mkdir(parents=True)
        (drafter / "config.json").write_text(f'{{"run": "{name}"}}')
        (drafter / "model.safetensors").write_bytes(os.urandom(1 << 16))
    (tmp_path / "outputs/h200/session").mkdir(parents=True)
    _session(tmp_path, "pipeline", STAGES="keep", KEEP_RUNS="A gone B")
    pieces = sorted(p.name for p in (tmp_path / "outputs/h200/pack").iterdir() if not p.name.startswith("."))
    assert pieces == ["drafter_A.tar.xz.aa", "drafter_B.tar.xz.aa"]
    stages = (tmp_path / "outputs/h200/session/stages.txt").read_text().splitlines()
    assert [(line.split()[0], line.split()[1] == "0") for line in stages] == [
        ("keep:A", True),
        ("keep:gone", False),
        ("keep:B", True),
    ]
    out = tmp_path / "unpacked"
    out.mkdir()
    piece = tmp_path / "outputs/h200/pack/drafter_B.tar.xz.aa"
    subprocess.run(f"xz -d < {piece} | tar -x -C {out}", shell=True, check=True)
    assert (out / "drafter/config.json").read_text() == '{"run": "B"}'


def test_extra_data_packs_are_unpacked_and_their_sets_join_training(tmp_path):
    """``EXTRA_DATA_PACKS``: each staged set is unpacked beside ``DATA_PACK``'s (its DONE.json brought back
    under its own name) and the stages after it train on all of them (``data.extra_dirs``); a pack that
    does not unpack stops the pipeline before training. ``python3`` stubbed: it records its arguments."""
    bin_dir, calls, staged = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "staged"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/bash\necho "$*" >> {calls}\n')
    (bin_dir / "python3").chmod(0o755)
    staged.mkdir()
    for name in ("smollm2_500_bfloat16", "smollm2_500_s1_bfloat16"):
        folder = tmp_path / "sets" / name
        (folder / "tokens").mkdir(parents=True)
        (folder / "DONE.json").write_text(f'{{"set": "{name}"}}')
        (folder / "tokens" / "train.safetensors").write_bytes(os.urandom(1 << 10))
        pack = f"tar -C {tmp_path / 'sets'} -cf - {name} | xz | split -b 15M - {staged / name}.tar.xz."
        subprocess.run(pack, shell=True, check=True)
    (tmp_path / "outputs/h200/session").mkdir(parents=True)
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")  # the stages call the checkout's scripts
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "N": 500, "NAME": "run", "STAGES": "data train",
           "DATA_PACK": staged / "smollm2_500_bfloat16.tar.xz"}  # fmt: skip
    _session(tmp_path, "pipeline", EXTRA_DATA_PACKS=staged / "smollm2_500_s1_bfloat16.tar.xz", **env)
    stages = (tmp_path / "outputs/h200/session/stages.txt").read_text()
    assert "data_unpack 0" in stages and "data_unpack:smollm2_500_s1_bfloat16 0" in stages
    out = tmp_path / "outputs/h200/out/data"
    assert (out / "DONE.json").read_text() == '{"set": "smollm2_500_bfloat16"}'
    assert (out / "DONE_smollm2_500_s1_bfloat16.json").read_text() == '{"set": "smollm2_500_s1_bfloat16"}'
    train = [c for c in calls.read_text().splitlines() if c.startswith("-m dspark.train")]
    assert train and "data.dir=outputs/h200/data/smollm2_500_bfloat16 " in train[0]
    assert "data.extra_dirs=[outputs/h200/data/smollm2_500_s1_bfloat16]" in train[0]
    union = [c for c in calls.read_text().splitlines() if c.startswith("-m dspark.data.union")]
    assert union == [
        "-m dspark.data.union outputs/h200/data/smollm2_500_bfloat16 "
        "outputs/h200/data/smollm2_500_s1_bfloat16 --json outputs/h200/out/data/union.json"
    ]

    calls.unlink()
    (tmp_path / "outputs/h200/session/stages.txt").unlink()
    _session(tmp_path, "pipeline", EXTRA_DATA_PACKS=staged / "missing.tar.xz", **env)
    stages = (tmp_path / "outputs/h200/session/stages.txt").read_text()
    assert "data_unpack:missing" in stages and "data_unpack:missing 0" not in stages
    assert "train" not in stages and not any(
        c.startswith("-m dspark.train") for c in calls.read_text().splitlines()
    )
