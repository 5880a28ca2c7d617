#!/usr/bin/env bash
# H200: one device session end to end, immune to the boundaries between device calls. The pipeline
# runs detached (setsid) on the held machine; each later call only waits on it and brings back what
# it has finished so far, so a training run spans calls without stopping, resuming or recompiling.
#   bash scripts/h200_session.sh start             # launch the stages below in the background
#   bash scripts/h200_session.sh wait SECONDS      # until the pipeline ends or SECONDS pass; then
#                                                  # $OUT/bundle.tgz (outputs/h200/out + the session log),
#                                                  # $OUT/evals.tgz (the evaluation folders)
# Stages run in order (STAGES, default "data train eval0 spec eval1"); each writes under
# outputs/h200/out (the layout of h200_drafter.sh) and appends "stage status seconds" to
# outputs/h200/session/stages.txt:
#   data    N conversations (N, default 30000) through the fast engine (h200_data.sh)
#   train   NAME (dspark) for TRAIN_MINUTES (10) with TRAIN_EXTRA overrides; a run that fails before
#           its first checkpoint is retried once as NAME_fallback with FALLBACK_EXTRA (dense attention,
#           eager layers and target): a compiler failure costs one retry, not the session
#   eval0   τ at T = 0 on the six benchmarks (EVAL_PROMPTS per benchmark, default 80)
#   spec    issue 18's speculation study with this drafter (h200_speculation.sh)
#   eval1   τ at T = 1
# Needs /root/stage (the staged GGUF and wheels, ../shared/GPU.md). Settings travel as environment
# variables of the `start` call, e.g.
#   N=30000 TRAIN_MINUTES=10 TRAIN_EXTRA="data.batch_size=32 optim.lr=1e-3" bash scripts/h200_session.sh start
set -uo pipefail
S=outputs/h200/session
step=${1:?start | wait SECONDS | pipeline}

bundle() {  # results and logs; the evaluation folders (rounds, generations) apart, in case they are large
  mkdir -p "${OUT:?}"
  tar -czf "$OUT/bundle.tgz" -C outputs/h200 out session 2>/dev/null
  (cd outputs/h200 && ls -d eval_* 2>/dev/null | tar -czf "$OUT/evals.tgz" -T - 2>/dev/null)
  ls -la "$OUT"
}

case $step in
start)
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
  echo "== stages"; cat $S/stages.txt
  echo "== log (last 30 lines)"; tr '\r' '\n' < $S/log.txt | grep -a -v -e Warning -e warn | tail -30
  [ -f $S/done ] && echo "PIPELINE DONE" || echo "pipeline still running"
  bundle
  ;;
pipeline)
  echo $$ > $S/pid
  export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DSPARK_INSTALLED=1
  export DSPARK_COMMIT=${DSPARK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
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
  for stage in ${STAGES:-data train eval0 spec eval1}; do
    case $stage in
    data) run data bash scripts/h200_drafter.sh data "${N:-30000}" || break ;;
    train)
      if ! run train train; then
        [ -f "outputs/h200/$name/checkpoints/last.ckpt" ] && break
        name=${name}_fallback TRAIN_EXTRA="${TRAIN_EXTRA:-} ${FALLBACK_EXTRA:-drafter.attention=dense drafter.compile=false compile_target=false}"
        run train_fallback train || break
      fi
      ;;
    eval0) run eval0 env EVAL_T=0 EVAL_PROMPTS="${EVAL_PROMPTS:-80}" bash scripts/h200_drafter.sh eval "$name" ;;
    eval1) run eval1 env EVAL_T=1 EVAL_PROMPTS="${EVAL_PROMPTS:-80}" bash scripts/h200_drafter.sh eval "$name" ;;
    spec) run spec env OUT=outputs/h200/out/speculation bash scripts/h200_speculation.sh "outputs/h200/$name/drafter" ;;
    *) echo "unknown stage '$stage'"; break ;;
    esac
  done
  touch $S/done
  ;;
*)
  echo "unknown step '$step': start | wait SECONDS" >&2
  exit 2
  ;;
esac
