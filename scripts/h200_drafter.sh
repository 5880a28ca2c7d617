#!/usr/bin/env bash
# H200: a strong drafter for SmolLM2-135M (TARGET: another staged conf/target, e.g. gemma3_270m),
# in steps that each fit one device call on one held machine (outputs/ survives between calls while
# the machine stays warm):
#   bash scripts/h200_drafter.sh data [N]                          # N conversations (30000) via the fast engine
#   bash scripts/h200_drafter.sh train NAME MINUTES [overrides…]    # e.g. train dspark 8 drafter=dspark head=markov
#     A run longer than one call: the call stops it after CALL_LIMIT seconds (default 540) with SIGINT;
#     the same command again resumes it from its checkpoint on the same clock-bounded schedule.
#     Records a profile window of the run (callbacks.profile: steps PROFILE_START.. +9, after warm-up and
#     compilation; PROFILE=false leaves it out) and copies it as $OUT/NAME/step_profile.{json,md} (+ the
#     Chrome trace step_profile_trace.json.gz when it is at most TRACE_MAX_MB, default 0: a 7 MB trace
#     rides in every later `h200_session.sh wait` bundle, and a machine went back while one came back).
#   bash scripts/h200_drafter.sh sweep PATTERN MINUTES JOBS [overrides…]   # a Hydra multirun, JOBS runs at once:
#     e.g. sweep 'DSpark-L${drafter.num_layers}' 12 3 drafter=dspark head=markov drafter.num_layers=1,2,3
#   bash scripts/h200_drafter.sh eval NAME [overrides…]            # τ at T = EVAL_T (0) on the six benchmarks
#     into outputs/h200/eval_NAME_t<T>, its results.json copied as $OUT/NAME/eval_t<T>.json; later
#     overrides win (e.g. engine=plain: the reference engine, for any drafter)
#   bash scripts/h200_drafter.sh pack [DEST]                        # the data folder as ≤ 15 MiB pieces
#   bash scripts/h200_drafter.sh probe [SECONDS]                    # where a real step's time goes (see below)
# Needs /root/stage (the GGUF and the hydra/omegaconf/antlr/gguf wheels, ../shared/GPU.md).
# Everything worth keeping is copied under $OUT/<NAME>/ (logs, summaries, results; no weights).
set -euo pipefail
export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export DSPARK_COMMIT=${DSPARK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# DSPARK_INSTALLED=1: a caller (scripts/h200_table1.sh) installed the checkout already. Calls started side by
# side install it one at a time (three evaluations at once raced, and one failed, in session -06-d).
[ -n "${DSPARK_INSTALLED:-}" ] ||
  flock /tmp/dspark-install.lock python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
N=${N:-30000}
TARGET=${TARGET:-smollm2_135m}  # a conf/target name whose GGUF is staged in /root/stage
T="target=$TARGET target.path=/root/stage target.device=cuda target.dtype=bfloat16"
# what scripts/h200_data.sh writes (smollm2_30000_bfloat16); DATA_NAME names a second set of one size, made
# with another data.seed (smollm2_200000_s1_bfloat16, say), that joins the first (data.extra_dirs)
GIVEN_DATA_NAME=${DATA_NAME:-}
DATA_NAME=${DATA_NAME:-${TARGET%%_*}_${N}_bfloat16}
DIR=outputs/h200/data/$DATA_NAME
# DATA_EXTRA: recipe overrides for both the data and the train step (they define the folder), e.g. another
# target answering a staged prompt set: DATA_EXTRA="data.source=jsonl data.jsonl.path=/root/stage/prompts.jsonl"
DATA="data=full data.num_prompts=$N data.dir=$DIR ${DATA_EXTRA:-}"
OUTDIR=${OUT:-outputs/h200/out}
step=${1:?data | train | sweep | eval | pack | probe}
shift
train_flags() {  # train_flags MINUTES: every training run's settings here (the clock bounds it)
  local minutes=$1
  echo data.anchors_per_sequence=128 trainer=gpu \
    trainer.max_time=00:$(printf %02d $((minutes / 60))):$(printf %02d $((minutes % 60))):00 \
    trainer.max_steps=10000000 trainer.val_check_interval=500 trainer.limit_val_batches=40 \
    callbacks.checkpoint_every_n_steps=1000 callbacks.profile.enabled="${PROFILE:-true}" \
    callbacks.profile.start_step="${PROFILE_START:-200}"
}
collect() {  # collect NAME LOG: what the run in outputs/h200/NAME left worth keeping, under $OUTDIR/NAME
  # (LOG: its output, for the recompile log)
  local name=$1 log=$2 run=outputs/h200/$1 recompiles f part trace
  mkdir -p "$OUTDIR/$name"
  recompiles=$(tr '\r' '\n' < "$log" | grep -a -A8 "Recompiling function" || true)
  if [ -n "$recompiles" ]; then
    echo "$recompiles" > "$OUTDIR/$name/recompiles.txt"
    echo "recompiles: $(grep -c "Recompiling function" <<< "$recompiles") (recompiles.txt)"
  fi
  cp $run/config.yaml "$OUTDIR/$name/"
  cp $run/summary.json "$OUTDIR/$name/" 2>/dev/null || true  # written when the run finishes
  cp $run/drafter/config.json "$OUTDIR/$name/drafter_config.json" 2>/dev/null || true
  cp $run/drafter/calibration*.json "$OUTDIR/$name/" 2>/dev/null || true
  # The profile window (written at its last step; a failed one leaves only its error in the JSON).
  for f in step_profile.json step_profile.md; do
    if [ -f $run/profile/$f ]; then cp $run/profile/$f "$OUTDIR/$name/"; fi
  done
  trace=$run/profile/trace.json.gz
  if [ -f $trace ] && [ "$(stat -c %s $trace)" -le $((${TRACE_MAX_MB:-0} * 1048576)) ]; then
    cp $trace "$OUTDIR/$name/step_profile_trace.json.gz"
  fi
  if [ -f $run/profile/step_profile.md ]; then sed -n 3p $run/profile/step_profile.md; fi  # what bounds the step
  # A resumed run logs each part in its own folder (logs/, logs/resumed-<step>/): keep them all.
  for f in $(find $run/logs -name metrics.csv | sort); do
    part=$(basename "$(dirname "$f")")
    cp "$f" "$OUTDIR/$name/metrics_${part}.csv"
  done
  python3 - $(find $run/logs -name metrics.csv | sort) <<'EOF'
import csv, sys
val = sorted({(int(r["step"]), float(r["val/tau_prob"])) for f in sys.argv[1:] for r in csv.DictReader(open(f))
              if r.get("val/tau_prob")})
print("val tau_prob by step:", ", ".join(f"{s}:{t:.3f}" for s, t in val))
EOF
  python3 - $run/summary.json <<'EOF' || true
import json, sys

t = json.load(open(sys.argv[1]))["throughput"]
ms = t.get("step_ms")
if ms:
    slow = ms["slowest"]
    print(f"ms per step: median {ms['median']:.1f}, slowest {slow['ms_per_step']:.1f} "
          f"(steps {slow['from_step']}-{slow['to_step']})")
print(f"seconds: setup {t.get('setup_seconds', float('nan')):.0f} (of it the sanity check "
      f"{t.get('sanity_seconds', float('nan')):.0f}), steps {t['seconds']:.0f}, "
      f"validation {t['validation_seconds']:.0f}")
EOF
}

case $step in
data)
  N=${1:-$N}
  DATA_NAME=${GIVEN_DATA_NAME:-${TARGET%%_*}_${N}_bfloat16}
  N=$N DATA_NAME=$DATA_NAME bash scripts/h200_data.sh
  mkdir -p "$OUTDIR/data" && cp outputs/h200/data/summary_*.txt "$OUTDIR/data/"
  [ ! -f outputs/h200/data/gpu_tests.log ] || cp outputs/h200/data/gpu_tests.log "$OUTDIR/data/"  # SKIP_GPU_TESTS: none
  cp "outputs/h200/data/$DATA_NAME/DONE.json" "$OUTDIR/data/"
  ;;
train)
  name=$1 minutes=$2
  shift 2
  run=outputs/h200/$name
  status=0
  # SIGINT: finish the step, save, exit; SIGKILL 60 s later if it has not (a call must end in time).
  # Dynamo's recompile log says why a compiled function compiled again (recompiles.txt): two runs on
  # the 90 k data stalled ~50 s between steps 579 and 589.
  # shellcheck disable=SC2046
  TORCH_LOGS=recompiles timeout -k 60 -s INT "${CALL_LIMIT:-540}" python3 -m dspark.train $T $DATA \
    $(train_flags "$minutes") hydra.run.dir=$run "$@" >> $run.log 2>&1 || status=$?
  if [ $status = 124 ]; then
    echo "stopped after ${CALL_LIMIT:-540} s: run the same command again to resume"
  elif [ $status != 0 ]; then
    tr '\r' '\n' < $run.log | tail -40
    exit 1
  fi
  tr '\r' '\n' < $run.log | grep -a -v Warning | tail -4
  collect "$name" $run.log
  ;;
sweep)
  # A Hydra multirun of the overrides' grid (their comma lists), JOBS runs at once on the shared GPU
  # (hydra-joblib-launcher, staged with the wheels), each MINUTES on the clock with train's settings,
  # run k in outputs/h200/<PATTERN as run k resolves it>, then collected like a train run. Every run's
  # output goes to outputs/h200/sweep.log (the session bundle keeps its tail; Hydra writes each run's
  # own log as <run>/train.log).
  pattern=$1 minutes=$2 jobs=$3
  shift 3
  status=0
  # shellcheck disable=SC2046
  TORCH_LOGS=recompiles timeout -k 60 "${CALL_LIMIT:-540}" python3 -m dspark.train -m hydra/launcher=joblib \
    hydra.launcher.n_jobs="$jobs" $T $DATA $(train_flags "$minutes") hydra.sweep.dir=outputs/h200 \
    "hydra.sweep.subdir=$pattern" "$@" >> outputs/h200/sweep.log 2>&1 || status=$?
  tr '\r' '\n' < outputs/h200/sweep.log | grep -a -e "Launching jobs" -e "#[0-9]* :" -e "done:" | tail -20 || true
  for run in outputs/h200/$(sed 's/\${[^}]*}/*/g' <<< "$pattern"); do  # the pattern's keys as wildcards
    [ -f "$run/config.yaml" ] && collect "$(basename "$run")" "$run/train.log"
  done
  [ $status = 0 ] || { tr '\r' '\n' < outputs/h200/sweep.log | tail -40; exit 1; }
  ;;
probe)
  # Where a real step's time goes, before a long run: `python -m dspark.bench.train_step --data` on
  # this data's batches with the real target (phases: target forward, drafter forward + loss,
  # backward, optimizer; variants in BENCH_VARIANTS), then short real runs (SECONDS on the clock,
  # no validation) of the override sets in PROBES (';'-separated), each with Lightning's simple
  # profiler and dynamo's recompile log. The fastest run's overrides (steady tokens/s) go to
  # outputs/h200/probe_best.txt, for `train … $(cat outputs/h200/probe_best.txt)`.
  secs=${1:-60}
  IFS=';' read -r -a probes <<< "${PROBES:-;compile_target=false}"
  mkdir -p "$OUTDIR/probe"
  # shellcheck disable=SC2086
  python3 -m dspark.bench.train_step --data $DIR --features online --anchors 128 --steps 20 --warmup 5 \
    --variants "${BENCH_VARIANTS:-default,graphed_target,eager_target}" --out "$OUTDIR/probe/train_step_data.json" \
    $T data=full drafter=dspark head=markov 2>&1 | grep -v Warning | tail -6
  : > outputs/h200/probe.tsv
  for i in "${!probes[@]}"; do
    run=outputs/h200/probe_$i
    rm -rf $run
    # shellcheck disable=SC2086
    TORCH_LOGS=recompiles python3 -m dspark.train $T $DATA data.anchors_per_sequence=128 trainer=gpu \
      trainer.max_time=$(printf 00:00:%02d:%02d $((secs / 60)) $((secs % 60))) trainer.max_steps=10000000 \
      trainer.limit_val_batches=0 trainer.num_sanity_val_steps=0 trainer.profiler=simple hydra.run.dir=$run \
      drafter=dspark head=markov ${probes[$i]} > $run.log 2>&1 || { tr '\r' '\n' < $run.log | tail -20; continue; }
    python3 - "$run/summary.json" "${probes[$i]}" <<'EOF' | tee -a outputs/h200/probe.tsv
import json, sys

s = json.load(open(sys.argv[1]))
rate = (s["throughput"].get("steady") or {}).get("tokens_per_s") or 0  # none: too few steps
print(f"{rate:.0f}\t{s['global_step']}\t{sys.argv[2]}")
EOF
    echo "  recompiles: $(grep -c 'Recompiling function' $run.log || true)"
    tr '\r' '\n' < $run.log | grep -a -A12 "|  Action" | cut -c1-160 | tr -s ' \t' ' ' || true
    cp $run.log "$OUTDIR/probe/probe_$i.log"
  done
  sort -t$'\t' -k1,1nr outputs/h200/probe.tsv | head -1 | cut -f3 > outputs/h200/probe_best.txt
  cp outputs/h200/probe.tsv "$OUTDIR/probe/"
  echo "fastest: '$(cat outputs/h200/probe_best.txt)'"
  ;;
pack)
  # What training and evaluation read (the build key, DONE.json, prompts, tokens; not the answer
  # shards, which tokens/ already holds), as <= 15 MiB pieces: a later session unpacks them with
  # `h200_session.sh`'s data stage (DATA_PACK) instead of regenerating.
  dest=${1:-$OUTDIR/pack}
  mkdir -p "$dest"
  name=$DATA_NAME
  tar -C outputs/h200/data -cf - "$name/build.json" "$name/DONE.json" "$name/prompts" "$name/tokens" |
    xz -T0 -6 | split -b 15M - "$dest/$name.tar.xz."
  ls -la "$dest"
  ;;
eval)
  name=$1
  shift
  t=${EVAL_T:-0}
  ev=outputs/h200/eval_${name}_t$t
  python3 -m dspark.evaluate $T drafter_dir=outputs/h200/$name/drafter temperature=$t engine=fast \
    max_prompts=${EVAL_PROMPTS:-80} max_new_tokens=256 concurrency=32 hydra.run.dir=$ev "$@" > $ev.log 2>&1 ||
    { tr '\r' '\n' < $ev.log | tail -40; exit 1; }
  tr '\r' '\n' < $ev.log | grep -a -v Warning | tail -12
  mkdir -p "$OUTDIR/$name"
  cp $ev/results.json "$OUTDIR/$name/eval_t$t.json"
  ;;
*)
  echo "unknown step '$step': data | train | sweep | eval | pack | probe" >&2
  exit 2
  ;;
esac
