#!/usr/bin/env bash
# H200: one device session end to end, immune to the boundaries between device calls. The pipeline
# runs detached (setsid) on the held machine; each later call only waits on it and brings back what
# it has finished so far, so a training run spans calls without stopping, resuming or recompiling.
#   bash scripts/h200_session.sh start             # launch the stages below in the background
#   bash scripts/h200_session.sh wait SECONDS      # until the pipeline ends or SECONDS pass; then
#                                                  # $OUT/bundle.tgz (outputs/h200/out + the session log;
#                                                  # each run still training: its metrics so far),
#                                                  # $OUT/evals.tgz (the evaluation folders)
# `wait` prints the stages, each run still training (its last logged step, step time and the time its steps
# left take at that pace: whether the runs fit the session's minutes) and the log's last WAIT_TAIL lines
# (default 8): short, so that whoever drives the calls can send the next `wait` inside the machine's 30 s
# idle window (a 30-line tail of benchmark tables was read while the window closed, twice: sessions
# 2026-12-04-f and -g lost their machine that way).
# Stages run in order (STAGES, default "data train eval0 spec eval1"); each writes under
# outputs/h200/out (the layout of h200_drafter.sh) and appends "stage status seconds" to
# outputs/h200/session/stages.txt (the bundle leaves out the evaluations' rounds and generations):
#   data    N conversations (N, default 30000) through the fast engine (h200_data.sh); with
#           PACK_DATA=1 also packed as <= 15 MiB pieces that `wait` brings back as files of their own
#           (h200_drafter.sh pack); with DATA_PACK=<path prefix of such pieces, e.g.
#           data/packs/smollm2_30000_bfloat16.tar.xz> unpacked instead of regenerated (no GPU time);
#           EXTRA_DATA_PACKS="<prefix> …": more sets unpacked beside it, whose training splits the later stages
#           join to it (data.extra_dirs; out/data/union.json says what they add up to): data made over several
#           sessions adds up (a second set of one size is made with DATA_NAME=smollm2_200000_s1_bfloat16
#           DATA_EXTRA="data.seed=1", say)
#   train   NAME (dspark) for TRAIN_MINUTES (10) with TRAIN_EXTRA overrides; a run that fails before
#           its first checkpoint is retried once as NAME_fallback with FALLBACK_EXTRA (dense attention,
#           eager layers and target): a compiler failure costs one retry, not the session
#   eval0   τ at T = 0 on the six benchmarks (EVAL_PROMPTS per benchmark, default 80)
#   gputests  the GPU tests of the kernels and the fast engine (h200_gpu_tests.sh; the data stage
#           runs them itself, so this is for sessions whose data comes from DATA_PACK)
#   gputests_bg  the same in the background, beside the next stages (a training run's first minutes
#           share the GPU with them: put its profile window later, PROFILE_START=4000); before a
#           data stage that generates, the generation shares the GPU with them and skips its own
#   keep    the trained drafter folder (NAME, or each of KEEP_RUNS="A B": a batch's runs, to evaluate
#           them again later, paired, without training them again) as <= 15 MiB pieces that `wait` brings
#           back as files of their own (drafter_NAME.tar.xz.aa, .ab ...; PACK_PER_CALL, default 3, new pieces a call: a
#           5-layer SmolLM2 DSpark-Markov, 178 MB, takes four calls), to study it on the CPU or stage it again;
#           KEEP_DTYPE=bfloat16 keeps a bf16 copy (cast_drafter: half the pieces, serves alike on a bf16
#           target; keep float32, the default, for a drafter that training will go on from)
#   restore with DRAFTER_PACK=<path prefix of such pieces, staged>: unpacked as NAME's drafter instead
#           of training (only where the pieces outlive the session: weights stay out of the repository);
#           before a train stage with TRAIN_EXTRA="init_from=outputs/h200/NAME/drafter ...", the weights
#           that training goes on from (a warm start: fresh data with DATA_EXTRA="data.seed=1", say)
#   cachekeep  the compiler's cache (every stage compiles into outputs/h200/compile_cache: Inductor's
#           FX graphs, AOTAutograd's joint graphs, the Triton kernels) as <= 15 MiB pieces
#           (compile_cache.tar.xz.aa …) that `wait` brings back; a later session stages them and sets
#           COMPILE_CACHE_PACK=<their path prefix>, unpacked before the first stage, so its training and
#           engines load the kernels instead of compiling them (PyTorch checks its own version, Triton's
#           and the GPU before it reuses one). It keeps what the stages before it compiled: right after
#           train, its pieces still come back in the session's later calls; last, it also holds the spec
#           stage's engines
#   spec    issue 18's speculation study with this drafter (h200_speculation.sh)
#   eval1   τ at T = 1
#   vocab   issue 18: the draft step and e2e runs with NAME's drafter over draft vocabularies of several
#           sizes against the whole vocabulary (h200_draft_vocab.sh; VOCAB_SIZES and the rest pass through);
#           VOCAB_RUNS="A B": each of a batch's runs instead, into out/draft_vocab/<run>/ (a sweep's drafters
#           side by side: the draft step of each head rank, say)
#   batch   Table 1 in one go: the RUNS drafters (';'-separated NAME:TRAIN_OVERRIDES, as for
#           h200_table1.sh) trained AT ONCE on the shared GPU for the same TRAIN_MINUTES on the clock
#           (TRAIN_EXTRA for all alike), each evaluated at T = 0 and 1 as soon as its own training ends,
#           beside the runs still training (BATCH_EVAL_EXTRA: evaluate overrides after the batch's own, e.g.
#           engine=plain; BATCH_TEMPERATURES="0": at T = 0
#           only, for a batch whose evaluations would not fit the session; the evaluate overrides it needs,
#           STS fitted on held-out prompts: the data's first CAL_PROMPTS (15) validation prompts and
#           CAL_PROMPTS of each benchmark past the EVAL_PROMPTS it reports, or the turns-JSONL
#           CAL_FILE; and raw, STS and STS with offsets scored on held-out requests of the evaluation's
#           rounds, python -m dspark.reporting.calibration_compare, into its calibration_compare.json),
#           then python -m dspark.report mode=table1 and
#           mode=figures into outputs/h200/out/table1/ (SPLIT_GAMMA=1: a table per temperature and γ, for
#           runs of different block sizes), and the runs' dashboard into its dashboard/. Steps per
#           drafter are in each run's summary: state the budget as minutes on a shared GPU, or compare
#           at equal steps: put
#           trainer.max_steps=S optim.schedule_by=steps in TRAIN_EXTRA and a TRAIN_MINUTES above the
#           time S steps take (without schedule_by=steps the learning rate follows whichever of steps
#           and clock is further along: runs sharing the GPU had their clock run ahead), so rows
#           trained in different sessions, alone or side by side, had the same budget.
#           SWEEP instead of RUNS: the runs are one Hydra multirun (an ablation grid, as a user runs it) of
#           the overrides in SWEEP (comma lists: the grid), SWEEP_JOBS (3) at once (the joblib launcher:
#           stage hydra-joblib-launcher and joblib with the wheels), each run in outputs/h200/<SWEEP_RUNS
#           resolved for it>, e.g. SWEEP="drafter=dspark head=markov drafter.num_layers=1,2,3"
#           SWEEP_RUNS='DSpark-L${drafter.num_layers}'; evaluated and reported as RUNS are, and its τ along
#           the swept key drawn as the paper's Figs. 3 / 4 are (python -m dspark.report mode=tau_by_axis,
#           into outputs/h200/out/table1/axis/).
#   headlat issue 19, Fig. 4's latency panel (python -m dspark.bench.head_latency): freshly built DFlash,
#           DSpark-Markov and DSpark-RNN drafters (5 layers, no training needed) at block sizes 4, 7, 10, 16,
#           R = 1 and 128, contexts HEADLAT_CONTEXTS (default 512,1024,2048,4096: the paper's, the figure
#           their mean): the sequential head's cost, the draft step, whole rounds and the head's share of
#           them, into outputs/h200/out/head_latency/ (JSON, fig4_latency.png, log.txt); 12 drafters, each
#           compiled and captured anew: 3-4 minutes with context 512 alone (2026-12-02-e), ≈ 55 s a drafter
#           with the four (2026-12-06-f, an H100), HEADLAT_LIMIT (960 s) at most; a run cut off keeps every
#           context it measured. HEADLAT_BLOCKS / HEADLAT_FAMILIES (default 4,7,10,16 / dflash,markov,rnn):
#           a part of the grid, joined with another session's on the CPU (mode=head_latency runs=[a,b]);
#           HEADLAT_EXTRA: drafter.… / head.… overrides for every drafter, e.g. "head.rank=32" (the Markov
#           head's cost at another rank; its JSON records them: report it apart from the default rank's),
#           and options, e.g. "--draft-vocab 32768 --draft-vocab-counts <a data folder of TARGET>" (every
#           drafter over those 32 768 tokens: Gemma's 262 144 make the head's sampling the cost). A
#           configuration out of device memory (Gemma, DFlash at block 16, R = 128 on an H100) is recorded
#           under out_of_memory in the JSON and the run goes on
# Needs /root/stage (the staged GGUF and wheels, ../shared/GPU.md). TARGET (default smollm2_135m)
# names the conf/target whose GGUF is staged there, for every stage; DATA_EXTRA the data recipe's
# overrides for the data and training stages alike (h200_drafter.sh), e.g. a base model such as
# gemma3_270m answering the SmolLM2 pack's prompts (its own Magpie prompts rarely finish; the pack in
# the repository holds them, {"id", "prompt"} lines, which data=jsonl reads as they are). Gemma needs the
# transformers==5.18.0 wheel staged with the others: the machine's 5.17 converts Gemma's GGUF tokenizer into
# one that cuts words into pieces (session 2026-12-07-c made 29 232 answers of nonsense with it; loading now
# refuses it):
#   cat data/packs/smollm2_30000_bfloat16.tar.xz.* | xz -d | tar -xO smollm2_30000_bfloat16/prompts/train.jsonl \
#     > outputs/h200/prompts.jsonl
#   TARGET=gemma3_270m N=29400 DATA_EXTRA="data.source=jsonl data.jsonl.path=outputs/h200/prompts.jsonl"
# Settings travel as environment variables of the `start` call, e.g.
#   N=30000 TRAIN_MINUTES=10 TRAIN_EXTRA="data.batch_size=32 optim.lr=1e-3" bash scripts/h200_session.sh start
#   NAME=DSpark-Markov STAGES="data batch spec" RUNS="DSpark-Markov:drafter=dspark head=markov" TRAIN_MINUTES=11 \
#     TRAIN_EXTRA="data.batch_size=32 optim.lr=1e-3 trainer.max_steps=4500" bash scripts/h200_session.sh start
#   STAGES="data batch" RUNS="DFlash:drafter=dflash;Eagle3:drafter=eagle3;DSpark-Markov:drafter=dspark head=markov" \
#     TRAIN_MINUTES=12 TRAIN_EXTRA="data.batch_size=32 optim.lr=1e-3" bash scripts/h200_session.sh start
#   DATA_PACK=data/packs/smollm2_30000_bfloat16.tar.xz STAGES="data gputests batch" RUNS=… TRAIN_EXTRA=… \
#     bash scripts/h200_session.sh start      # the committed data instead of six minutes regenerating it
#   STAGES=headlat bash scripts/h200_session.sh start   # Fig. 4's latency panel alone (no data, no drafter)
#   NAME=DSpark-RNN-B16 KEEP_DTYPE=bfloat16 STAGES="data batch keep" SWEEP=… SWEEP_RUNS='DSpark-RNN-B${drafter.block_size}' …
#     # a batch run's drafter brought back (NAME: its folder under outputs/h200, SWEEP_RUNS resolved)
#   KEEP_RUNS="Eagle3 DFlash" KEEP_DTYPE=bfloat16 STAGES="data batch keep" RUNS="Eagle3:…;DFlash:…" …
#     # every run of the batch brought back (a bf16 5-layer SmolLM2 DFlash: 3 pieces, one call)
set -uo pipefail
S=outputs/h200/session
step=${1:?start | wait SECONDS | pipeline}

bundle() {  # results and logs; the evaluation folders (rounds, generations) apart, in case they are large
  mkdir -p "${OUT:?}" outputs/h200/out/logs
  for log in outputs/h200/*.log; do  # each training / evaluation log's last 300 lines but progress bars, then its last 5
    [ -f "$log" ] || continue
    { tr '\r' '\n' < "$log" | grep -av -E '(it/s|s/it)[],]' | tail -300; echo "== last lines"
      tr '\r' '\n' < "$log" | tail -5; } > "outputs/h200/out/logs/$(basename "$log")"
  done
  # Each run still training: its metrics so far and its config, named as h200_drafter.sh's collect names
  # them (collect overwrites them when the run ends), so that a session whose machine goes before its runs
  # end still brings back their validation curves, to compare with another run's at the same steps.
  local run name metrics f
  for run in outputs/h200/*/; do
    run=${run%/} name=$(basename "$run")
    [ ! -f "$run/summary.json" ] && [ -d "$run/logs" ] || continue
    metrics=$(find "$run/logs" -name metrics.csv | sort)
    [ -n "$metrics" ] || continue
    mkdir -p "outputs/h200/out/$name"
    cp "$run/config.yaml" "outputs/h200/out/$name/" 2>/dev/null || true
    for f in $metrics; do
      cp "$f" "outputs/h200/out/$name/metrics_$(basename "$(dirname "$f")").csv"
    done
  done
  tar -czf "$OUT/bundle.tgz" -C outputs/h200 out session 2>/dev/null
  # The pieces (PACK_DATA, keep, cachekeep), each its own file: PACK_PER_CALL (3, 45 MiB) not sent by an
  # earlier call, as a call brings back at most 64 MiB (sent ones are listed in pack/.sent).
  local piece sent=0
  mkdir -p outputs/h200/pack && touch outputs/h200/pack/.sent
  for piece in outputs/h200/pack/*; do
    [ -f "$piece" ] && [ $sent -lt "${PACK_PER_CALL:-3}" ] || continue
    grep -qxF "$(basename "$piece")" outputs/h200/pack/.sent && continue
    cp "$piece" "$OUT/" && basename "$piece" >> outputs/h200/pack/.sent && sent=$((sent + 1))
  done
  # rounds.jsonl / generations.jsonl: 10-20 MB per evaluation, over the 16 MiB a file may bring back.
  (cd outputs/h200 && ls -d eval_* 2>/dev/null |
    tar -czf "$OUT/evals.tgz" --exclude=rounds.jsonl --exclude=generations.jsonl -T - 2>/dev/null)
  ls -la "$OUT"
}

progress() {  # each run still training: its last logged step, step time, the time to its step budget and
  # its last validation (τ_prob, position 1's c*: whether a run is on course before it ends)
  local m run
  for m in outputs/h200/*/logs/metrics.csv; do
    run=$(dirname "$(dirname "$m")")
    [ -f "$m" ] && [ ! -f "$run/summary.json" ] || continue
    python3 - "$run" <<'PY'
import csv, os, sys
run = sys.argv[1]
last, val = {}, None
with open(os.path.join(run, "logs", "metrics.csv"), newline="") as f:
    for row in csv.DictReader(f):
        last.update({k: v for k, v in row.items() if v})  # Lightning logs a row per metric group
        if row.get("val/tau_prob"):
            val = row
line = f"{os.path.basename(run)}: step {last.get('step', '?')}"
if last.get("train/step_ms"):
    ms = float(last["train/step_ms"])
    line += f", {ms:.0f} ms a step"
    try:
        import yaml
        with open(os.path.join(run, ".hydra", "config.yaml")) as f:
            total = int(yaml.safe_load(f)["trainer"]["max_steps"])
        if total > 0:
            line += f", ~{(total - 1 - int(last['step'])) * ms / 1000:.0f} s to step {total} at that pace"
    except (ImportError, OSError, KeyError, TypeError, ValueError):
        pass  # no step budget known: the pace alone
if val:
    line += f"; validation at step {val['step']}: tau_prob {float(val['val/tau_prob']):.3f}"
    if val.get("val/c_star_1"):
        line += f", c*_1 {float(val['val/c_star_1']):.3f}"
print(line)
PY
  done
}

case $step in
start)
  for t in ${BATCH_TEMPERATURES:-0 1}; do  # refused here, before a machine's minutes go into training
    case $t in 0 | 1) ;; *) echo "BATCH_TEMPERATURES: '$t' is not 0 or 1 (e.g. \"0\" or \"0 1\")"; exit 2 ;; esac
  done
  mkdir -p $S outputs/h200/out
  [ -f $S/pid ] && kill -0 "$(cat $S/pid)" 2>/dev/null && { echo "pipeline already running"; exit 0; }
  : > $S/stages.txt
  rm -f $S/done $S/pid
  env -u OUT setsid nohup bash "$0" pipeline > $S/log.txt 2>&1 < /dev/null &
  while [ ! -f $S/pid ]; do sleep 1; done
  echo "pipeline started (pid $(cat $S/pid)): stages ${STAGES:-data train eval0 spec eval1}"
  ;;
wait)
  limit=${2:?seconds}
  while [ ! -f $S/done ] && [ $SECONDS -lt "$limit" ] && kill -0 "$(cat $S/pid)" 2>/dev/null; do sleep 5; done
  # The bundle first: a reader that closes the pipe early (`wait 60 | head`) must not cost it.
  listing=$(bundle)
  echo "== stages"; cat $S/stages.txt
  echo "== training"; progress
  echo "== log (last ${WAIT_TAIL:-8} lines)"
  tr '\r' '\n' < $S/log.txt | grep -a -v -e Warning -e warn | tail -"${WAIT_TAIL:-8}"
  [ -f $S/done ] && echo "PIPELINE DONE" || echo "pipeline still running"
  echo "$listing"
  ;;
pipeline)
  echo $$ > $S/pid
  export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DSPARK_INSTALLED=1
  export DSPARK_COMMIT=${DSPARK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  # Every stage compiles into one folder (cachekeep packs it): Inductor's graphs and kernels, and the
  # Triton kernels of dspark.kernels, which Triton would otherwise cache under ~/.triton.
  export TORCHINDUCTOR_CACHE_DIR=$PWD/outputs/h200/compile_cache
  export TRITON_CACHE_DIR=$TORCHINDUCTOR_CACHE_DIR/triton
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
  name=${NAME:-dspark}
  minutes=${TRAIN_MINUTES:-10}
  run() {  # run STAGE COMMAND...: time it and record its status
    local stage=$1 t0=$SECONDS status=0
    shift
    echo "== $stage: $*"
    "$@" || status=$?
    echo "$stage $status $((SECONDS - t0))" >> $S/stages.txt
    return $status
  }
  train() {
    # 240 s beyond the clock: compilation, the last validation, calibration and the export.
    CALL_LIMIT=$((minutes * 60 + 240)) bash scripts/h200_drafter.sh train "$name" "$minutes" \
      drafter=dspark head=markov ${TRAIN_EXTRA:-}
  }
  # Pieces are written into outputs/h200/pack.tmp and moved into outputs/h200/pack when all are
  # there: `wait` sends what is in pack/, never a piece still being written.
  arrive() {
    du -ch outputs/h200/pack.tmp/* | tail -1
    mkdir -p outputs/h200/pack && mv outputs/h200/pack.tmp/* outputs/h200/pack/ && rmdir outputs/h200/pack.tmp
  }
  pack() {  # pack PARENT DIR NAME: PARENT/DIR as NAME.tar.xz.aa, .ab … (<= 15 MiB each, unpacked under a PARENT)
    rm -rf outputs/h200/pack.tmp && mkdir -p outputs/h200/pack.tmp
    tar -C "$1" -cf - "$2" | xz -T0 -3 | split -b 15M - "outputs/h200/pack.tmp/$3.tar.xz." && arrive
  }
  pack_data() {  # PACK_DATA: what training and evaluation read of the data (h200_drafter.sh pack)
    rm -rf outputs/h200/pack.tmp && bash scripts/h200_drafter.sh pack outputs/h200/pack.tmp && arrive
  }
  unpack_data() {  # unpack_data PREFIX [COPY]: PREFIX.aa, PREFIX.ab ... -> outputs/h200/data/, checked; its
    # DONE.json copied to out/data/COPY (DONE.json)
    mkdir -p outputs/h200/data
    cat "$1".* | xz -d | tar -x -C outputs/h200/data || return 1
    local dir=outputs/h200/data/$(basename "$1" .tar.xz)
    [ -f "$dir/DONE.json" ] && ls "$dir"/tokens/*.safetensors > /dev/null || return 1
    mkdir -p outputs/h200/out/data && cp "$dir/DONE.json" "outputs/h200/out/data/${2:-DONE.json}"
  }
  data_dir() {  # the folder the data stage made or unpacked (h200_drafter.sh names it alike)
    local tgt=${TARGET:-smollm2_135m}
    echo "outputs/h200/data/${DATA_NAME:-${tgt%%_*}_${N:-30000}_bfloat16}"
  }
  batch() {
    local data cal=${CAL_FILE:-outputs/h200/batch_calibration.jsonl}
    data=$(data_dir)
    local dest=outputs/h200/out/table1 specs n o t sources=()
    if [ -z "${CAL_FILE:-}" ]; then
      python3 -m dspark.bench.batch calibration-prompts "$data" "$cal" "${CAL_PROMPTS:-15}" "${EVAL_PROMPTS:-80}" \
        > /dev/null || return 2
    fi
    # Each run is evaluated as soon as its own training has written its summary, beside the runs still
    # training: a batch's short runs (a small block, a shallow drafter) bring their τ back minutes before
    # the long ones end, and a session cut short keeps them. Its temperatures run at once too: the last
    # run's evaluations are the batch's tail (T = 0 then 1 one after the other took 238 s of a session's
    # last minutes, 2026-12-06-e). τ does not depend on timing, so sharing the GPU changes no number.
    evaluate() {
      local n=$1 t args
      [ -f "outputs/h200/$n/drafter/config.json" ] || return 0
      args=$(python3 -m dspark.bench.batch eval-args "outputs/h200/$n/drafter" "$cal")
      for t in ${BATCH_TEMPERATURES:-0 1}; do
        # shellcheck disable=SC2086
        { run "eval:$n:t$t" env EVAL_T=$t EVAL_PROMPTS="${EVAL_PROMPTS:-80}" bash scripts/h200_drafter.sh eval "$n" \
            $args ${BATCH_EVAL_EXTRA:-} > "$S/eval_${n}_t$t.txt" 2>&1
          [[ $args != *calibrate=true* ]] || held_out_calibration "$n" "$t"; } &
      done
      wait
    }
    # A drafter with a confidence head: raw, STS and STS with offsets each fitted and scored on held-out
    # requests of its benchmark rounds (calibration_compare, the device's CPU), beside the evaluation in
    # its folder: the rounds themselves are too large to bring back (10-20 MB).
    held_out_calibration() {
      local e=outputs/h200/eval_$1_t$2
      [ -f "$e/results.json" ] || return 0
      run "calib:$1:t$2" python3 -m dspark.reporting.calibration_compare "$e" --out "$e/calibration_compare.json" \
        > "$e/calibration_compare.txt" 2>&1 || echo "held-out calibration of $e failed (its τ stands)"
    }
    if [ -n "${SWEEP:-}" ]; then  # one Hydra multirun: its runs at once, the GPU shared
      local glob r sweep_pid alive started=" "
      glob=$(sed 's/\${[^}]*}/*/g' <<< "${SWEEP_RUNS:?SWEEP_RUNS: the pattern of the runs folder names, with SWEEP}")
      # shellcheck disable=SC2086
      run sweep env CALL_LIMIT=$((minutes * 60 + 300)) bash scripts/h200_drafter.sh sweep "$SWEEP_RUNS" \
        "$minutes" "${SWEEP_JOBS:-3}" $SWEEP ${TRAIN_EXTRA:-} > "$S/sweep.txt" 2>&1 &
      sweep_pid=$!
      while :; do  # the multirun's runs as each finishes (summary.json: written after the drafter)
        kill -0 $sweep_pid 2>/dev/null && alive=1 || alive=0
        for r in outputs/h200/$glob; do
          n=$(basename "$r")
          [ -f "$r/summary.json" ] && [[ $started != *" $n "* ]] || continue
          started+="$n "
          evaluate "$n" &
        done
        [ $alive = 1 ] || break
        sleep 2
      done
      wait
      specs=$(for r in outputs/h200/$glob; do [ -f "$r/config.yaml" ] && printf '%s\t\n' "$(basename "$r")"; done)
    else
      IFS=';' read -r -a runs <<< "${RUNS:?RUNS: NAME:TRAIN_OVERRIDES;… for the batch stage (or SWEEP)}"
      specs=$(python3 -m dspark.bench.batch split "${runs[@]}") || return 2
      while IFS=$'\t' read -r n o; do  # all at once: each its own process, the GPU shared
        { run "train:$n" env CALL_LIMIT=$((minutes * 60 + 300)) \
            bash scripts/h200_drafter.sh train "$n" "$minutes" $o ${TRAIN_EXTRA:-} > "$S/train_$n.txt" 2>&1
          evaluate "$n"; } &
      done <<< "$specs"
      wait
    fi
    [ -n "$specs" ] || return 1
    for t in ${BATCH_TEMPERATURES:-0 1}; do
      while IFS=$'\t' read -r n o; do
        [ -f "outputs/h200/eval_${n}_t$t/results.json" ] && sources+=("$n:outputs/h200/eval_${n}_t$t")
      done <<< "$specs"
    done
    [ ${#sources[@]} -gt 0 ] || return 1
    mkdir -p "$dest"
    local list="runs=[$(IFS=,; echo "${sources[*]}")]"
    # SPLIT_GAMMA=1: one table per temperature and γ (a block-size sweep's runs differ in γ)
    python3 -m dspark.report mode=table1 "$list" ${SPLIT_GAMMA:+split_gamma=true} table1="$dest/table1.json" \
      hydra.run.dir="$dest/table1_log"
    python3 -m dspark.report mode=figures "$list" hydra.run.dir="$dest"
    # The ablation dashboard of these runs (curves, configs, the key that differs across them) with
    # their evaluations.
    local folders=()
    while IFS=$'\t' read -r n o; do
      for f in "outputs/h200/$n" "outputs/h200/eval_${n}_t0" "outputs/h200/eval_${n}_t1"; do
        [ -d "$f" ] && folders+=("$f")
      done
    done <<< "$specs"
    python3 -m dspark.report "runs=[$(IFS=,; echo "${folders[*]}")]" hydra.run.dir="$dest/dashboard" ||
      echo "dashboard of the batch failed (Table 1 and the figures stand)"
    # A sweep's τ along its key in the paper's layout (Fig. 3 / Fig. 4's τ panel), by domain.
    [ -z "${SWEEP:-}" ] || python3 -m dspark.report mode=tau_by_axis "runs=[$(IFS=,; echo "${folders[*]}")]" \
      hydra.run.dir="$dest/axis" > /dev/null || echo "the sweep's τ figure failed (Table 1 and the figures stand)"
  }
  headlat() {  # Fig. 4's latency panel; the JSON is rewritten after each drafter, so a cut-off run keeps its rows
    local dest=outputs/h200/out/head_latency status=0
    mkdir -p "$dest"
    # shellcheck disable=SC2086  # HEADLAT_EXTRA: overrides, one word each
    timeout "${HEADLAT_LIMIT:-960}" python3 -m dspark.bench.head_latency target="${TARGET:-smollm2_135m}" \
      target.path=/root/stage target.device=cuda target.dtype=bfloat16 --families "${HEADLAT_FAMILIES:-dflash,markov,rnn}" \
      --blocks "${HEADLAT_BLOCKS:-4,7,10,16}" --rows 1,128 --context "${HEADLAT_CONTEXTS:-512,1024,2048,4096}" \
      --out "$dest/head_latency.json" ${HEADLAT_EXTRA:-} > "$dest/log.txt" 2>&1 || status=$?
    [ -f "$dest/head_latency.json" ] && python3 -m dspark.report mode=head_latency runs="$dest/head_latency.json" \
      hydra.run.dir="$dest" >> "$dest/log.txt" 2>&1  # fig4_latency.png, also of a cut-off run's rows
    grep -a -e "^|" -e "^== " "$dest/log.txt" | tail -45  # the table (and where a cut-off run stopped)
    return $status
  }
  if [ -n "${COMPILE_CACHE_PACK:-}" ]; then  # an earlier session's cachekeep pieces, staged
    run cache_restore bash -c "cat '$COMPILE_CACHE_PACK'.* | xz -d | tar -x -C outputs/h200 &&
      du -sh outputs/h200/compile_cache" || echo "no compile cache restored: the stages compile afresh"
  fi
  for stage in ${STAGES:-data train eval0 spec eval1}; do
    case $stage in
    data)
      if [ -n "${DATA_PACK:-}" ]; then  # the pieces an earlier session's PACK_DATA brought back
        run data_unpack unpack_data "$DATA_PACK" || break
      else
        # after gputests_bg the tests run already, beside the generation: the data stage skips them
        run data env SKIP_GPU_TESTS=${gpu_tested:-} bash scripts/h200_drafter.sh data "${N:-30000}" || break
        gpu_tested=1
        [ -z "${PACK_DATA:-}" ] || run data_pack pack_data
      fi
      joined=
      for more in ${EXTRA_DATA_PACKS:-}; do  # more sets' pieces: their training splits join this one's
        set_name=$(basename "$more" .tar.xz)
        run "data_unpack:$set_name" unpack_data "$more" "DONE_$set_name.json" || break 2
        joined=${joined:+$joined,}outputs/h200/data/$set_name
      done
      if [ -n "$joined" ]; then
        export DATA_EXTRA="${DATA_EXTRA:-} data.extra_dirs=[$joined]"
        # what the later stages train on (each folder's conversations, joined, tokens), for the results
        run data_union python3 -m dspark.data.union "$(data_dir)" \
          ${joined//,/ } --json outputs/h200/out/data/union.json > /dev/null || true
      fi
      ;;
    train)
      if ! run train train; then
        [ -f "outputs/h200/$name/checkpoints/last.ckpt" ] && break
        name=${name}_fallback TRAIN_EXTRA="${TRAIN_EXTRA:-} ${FALLBACK_EXTRA:-drafter.attention=dense drafter.compile=false compile_target=false graph_target=false}"
        run train_fallback train || break
      fi
      ;;
    keep)  # NAME's drafter, or each of KEEP_RUNS (a batch's runs): one missing does not stop the others
      for kept in ${KEEP_RUNS:-$name}; do
        from=outputs/h200/$kept
        if [ "${KEEP_DTYPE:-float32}" != float32 ]; then  # a cast copy, packed instead
          from=outputs/h200/keep.tmp && rm -rf "$from"
          run "keep_cast:$kept" python3 -c "import sys; from dspark.checkpoints import cast_drafter; cast_drafter(*sys.argv[1:])" \
            "outputs/h200/$kept/drafter" "$from/drafter" "$KEEP_DTYPE" || continue
        fi
        run "keep:$kept" pack "$from" drafter "drafter_$kept"
      done
      ;;
    cachekeep) run cachekeep pack outputs/h200 compile_cache compile_cache ;;
    restore)
      mkdir -p "outputs/h200/$name"
      run restore bash -c "cat '${DRAFTER_PACK:?DRAFTER_PACK: the drafter pieces to restore}'.* |
        xz -d | tar -x -C outputs/h200/$name && test -f outputs/h200/$name/drafter/config.json" || break
      ;;
    eval0) run eval0 env EVAL_T=0 EVAL_PROMPTS="${EVAL_PROMPTS:-80}" bash scripts/h200_drafter.sh eval "$name" ;;
    eval1) run eval1 env EVAL_T=1 EVAL_PROMPTS="${EVAL_PROMPTS:-80}" bash scripts/h200_drafter.sh eval "$name" ;;
    spec)  # skips the engine's GPU tests when the data stage ran them, or GPU_TESTS_DONE=1 says they
      # passed on the GPU at this commit already (they take 2-3 of the session's minutes)
      run spec env OUT=outputs/h200/out/speculation GPU_TESTS_DONE=${gpu_tested:-${GPU_TESTS_DONE:-}} \
        bash scripts/h200_speculation.sh "outputs/h200/$name/drafter"
      ;;
    gputests)  # the data stage runs them itself; with DATA_PACK this stage does, before anything timed
      run gputests bash scripts/h200_gpu_tests.sh outputs/h200/out/gpu_tests.log && gpu_tested=1
      ;;
    gputests_bg)
      run gputests bash scripts/h200_gpu_tests.sh outputs/h200/out/gpu_tests.log &
      gpu_tested=1
      ;;
    batch) run batch batch ;;
    headlat) run headlat headlat ;;  # needs no drafter: any session can run it
    vocab)  # NAME's drafter into draft_vocab/, or each of VOCAB_RUNS (a batch's runs) into draft_vocab/<run>/
      if [ -z "${VOCAB_RUNS:-}" ]; then
        run vocab env OUT=outputs/h200/out/draft_vocab bash scripts/h200_draft_vocab.sh "outputs/h200/$name/drafter"
      else
        for measured in $VOCAB_RUNS; do  # one that fails does not stop the others
          run "vocab:$measured" env OUT="outputs/h200/out/draft_vocab/$measured" \
            bash scripts/h200_draft_vocab.sh "outputs/h200/$measured/drafter"
        done
      fi
      ;;
    *) echo "unknown stage '$stage'"; break ;;
    esac
  done
  wait  # gputests_bg
  touch $S/done
  ;;
*)
  echo "unknown step '$step': start | wait SECONDS" >&2
  exit 2
  ;;
esac
