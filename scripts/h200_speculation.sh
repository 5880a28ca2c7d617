#!/usr/bin/env bash
# H200, issue 18 (speculation that pays at every load), in about 11 minutes (29 at most):
#   1. the fast engine's GPU tests (graphs under every policy, rounds launched without a host
#      sync, the compiled drafter against the eager one), unless GPU_TESTS_DONE is set;
#   2. per temperature (E2E_TEMPERATURES, default "0 1", spaces or commas; greedy rounds at T = 0 build no
#      distributions, so their steps cost less) the cost table, all of it at the e2e prompts' mean
#      context (ROUND_CONTEXT, default 172: gsm8k's 108 prompt tokens plus half the 128 new ones):
#      the verify curve, the draft step per R and drafted length, a round's overhead beyond its
#      steps and the cost of reading its width back, whole rounds per R and drafted length; with
#      the first temperature's (unless SPEC_DIAGNOSE=0) the draft step's parts, the cache-attention
#      kernel split against unsplit, each step's kernels at R = 1 and 256 (SPEC_DIAGNOSE=kernels:
#      these alone, among them a plain round's step against target-only's)
#      (python -m dspark.bench.engine_sps); then
#   3. python -m dspark.bench.e2e at that temperature with its table, R = 1, 16, 64, 256:
#      target-only, fixed γ = 7, 5, 3 and 1 (mtp1), threshold, hardware_aware and draft_aware
#      (E2E_POLICIES: fewer, when minutes are short, or variants, e.g. draft_aware:probe_every=128; E2E_CONCURRENCY: fewer R, e.g. the headline
#      "E2E_TEMPERATURES=0 E2E_CONCURRENCY=1 E2E_POLICIES=fixed SPEC_DIAGNOSE=0" in about two minutes;
#      gsm8k, 32 prompts, 128 new tokens, bf16, fast engine, compiled on CUDA; E2E_WAVES · R requests
#      through the R slots, default 1: one batch, its speeds at the load R reported apart from its drain);
#   4. the measured frontier and the budget plot per temperature (Figs. 7 and 8: python -m
#      dspark.schedule mode=e2e), and its check of the rounds against the cost table (cost_check);
#   5. with SPEC_PROFILE (policy names), the host's work a round under cProfile per policy
#      (python -m dspark.bench.round_profile, round_profile_<policy>.json; see below); with
#      HOST_LOAD="R µs" (e.g. "256 700"), the host-bound check: e2e at that R and the first temperature,
#      target-only and fixed_0 (an engine that carries the drafter, never drafting), with a busy wait
#      of µs before each round's completion (e2e --host-load-us; host_load_T<t>.json): whether the same
#      launches cost more once the host sets the pace (compare their launch_parts with e2e_T<t>.json's);
#      with PIPELINE_CHECK="R policies" (e.g. "256 fixed_0,draft_aware,hardware_aware"), e2e at that R and
#      the first temperature with two rounds launched ahead of the one read (--pipeline 2;
#      pipeline_T<t>.json) against e2e_T<t>.json's one (E2E_PIPELINE sets the main runs' own);
#   6. unless SPEC_KERNELS=0, the kernel benchmarks, last: the greedy draft kernel, the top-p kernel
#      and the draft step's LM head against the steps they replace, as graph replays (python -m dspark.bench.decode_kernels,
#      decode_kernels.json); one target layer's functions eager, with every size symbolic, as the engine
#      compiles them and per shape, at R x W = 1 x 8, 256 x 1, 256 x 8 (python -m dspark.bench.layer_compile,
#      layer_compile.json).
# Needs /root/stage (SmolLM2 and the wheels, staged beforehand) and a trained drafter:
#   bash scripts/h200_speculation.sh [drafter folder]     # default outputs/h200/dspark/drafter
# Writes 21 files into $OUT (default outputs/h200/speculation): log.txt, decode_kernels.json, layer_compile.json,
# engine_sps_T{0,1}.json, cost_table_T{0,1}.json, e2e_T{0,1}.json, fig7_T{0,1}.png/.json,
# fig8_T{0,1}.png/.json, cost_check_T{0,1}.png/.json. Each stage has its own time limit (120 + 270 + 420 + 180 + 600 +
# 2 x 60 + 120 + 150 s at most: each e2e point is the median of E2E_REPEATS timed runs, default 3;
# with one wave the two e2e runs took ~150 and 215 s, 2026-12-04-e)
# and writes what it measured as it goes, so a slow stage never costs the next ones their time.
set -uo pipefail
export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export DSPARK_COMMIT=${DSPARK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
DRAFTER=${1:-outputs/h200/dspark/drafter}
OUT=${OUT:-outputs/h200/speculation}
WORK=outputs/h200/speculation/scratch
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1
T="target=${TARGET:-smollm2_135m} target.path=/root/stage target.device=cuda target.dtype=bfloat16"
quiet() { grep -v -e "^Loading" -e "FutureWarning" -e "return forward_call"; }
# SPEC_DRAFT_VOCAB=K: the drafter drafts among its K most frequent training-answer tokens in every
# cost table and e2e run (engine_sps / e2e --draft-vocab; its counts from the drafter folder, or from
# SPEC_DRAFT_VOCAB_COUNTS, the data folder it was trained on)
vocab=()
[ "${SPEC_DRAFT_VOCAB:-0}" = 0 ] || vocab=(--draft-vocab "$SPEC_DRAFT_VOCAB")
[ -z "${SPEC_DRAFT_VOCAB_COUNTS:-}" ] || vocab+=(--draft-vocab-counts "$SPEC_DRAFT_VOCAB_COUNTS")
started=$SECONDS
stage() { echo "== $1 ($((SECONDS - started)) s)"; }
# Spaces or commas: a comma list ("0,1", as the other lists are written) once ran no stage at all.
temperatures=${E2E_TEMPERATURES:-0 1}
temperatures=${temperatures//,/ }
for t in $temperatures; do
  [[ $t =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "E2E_TEMPERATURES: '$t' is not a temperature (e.g. \"0 1\" or 0,1)"; exit 2; }
done

python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ -f "$DRAFTER/config.json" ] || { echo "no drafter checkpoint at $DRAFTER (config.json)"; exit 2; }

if [ -z "${GPU_TESTS_DONE:-}" ]; then  # set by h200_session.sh when its data stage ran them
  # 26 tests: 112 s after a training run warmed the compiler's cache, 157 s on a fresh machine (2026-12-04-d).
  # No -q: pyproject's addopts has one, and -qq drops the summary line.
  stage "GPU tests of the engine"
  timeout 200 python3 -m pytest -p no:cacheprovider -m gpu tests/test_fast_engine.py \
    -k "not test_compiled_layers_match_eager" 2>&1 | quiet | tail -8
  echo "pytest exit status ${PIPESTATUS[0]}"
fi

for t in $temperatures; do
  # A cost table per temperature (greedy rounds build no distributions: their steps cost less);
  # the diagnostics (draft parts, attention splits, kernels) once, with the first temperature's.
  # Every piece of the table at the workload's context: the policies price these rounds, not longer
  # ones. Widths 1, 2, 4, 8: the verify step per width at each R (verify_width_ms), which prices a
  # padded walk's depths. Each e2e run has its own limit: T = 1 once got none left after T = 0.
  diagnose=()
  if [ -z "${diagnosed:-}" ]; then
    case "${SPEC_DIAGNOSE:-1}" in
      1) diagnose=(--draft-parts 1,16,64,256 --attention-splits 1,16,64,256 --kernels 1,256) ;;
      kernels) diagnose=(--kernels 1,256) ;;
    esac
    diagnosed=1
  fi
  stage "cost table, T = $t"
  timeout $((${#diagnose[@]} ? 270 : 180)) python3 -m dspark.bench.engine_sps $T --context "${ROUND_CONTEXT:-172}" \
    --no-hf --warmup 3 --repeats 15 --widths 1,2,4,8 --temperature $t \
    --drafter-dir "$DRAFTER" ${vocab[@]+"${vocab[@]}"} --overhead --rounds "${E2E_CONCURRENCY:-1,16,64,256}" --round-context "${ROUND_CONTEXT:-172}" \
    ${diagnose[@]+"${diagnose[@]}"} --out "$OUT/engine_sps_T$t.json" --cost-table "$OUT/cost_table_T$t.json" 2>&1 |
    quiet | tail -60

  stage "end to end, T = $t"
  # E2E_LIMIT (s): four waves at T = 1 ran past 420 s before R = 256 on the H200 (2026-12-05), at T = 0 354 s on an H100.
  timeout "${E2E_LIMIT:-$([ $t = 0 ] && echo 420 || echo 600)}" python3 -m dspark.bench.e2e $T --drafter-dir "$DRAFTER" \
    ${vocab[@]+"${vocab[@]}"} \
    --benchmark gsm8k --prompts 32 --concurrency "${E2E_CONCURRENCY:-1,16,64,256}" --max-new-tokens 128 --temperature $t \
    --repeats "${E2E_REPEATS:-3}" --waves "${E2E_WAVES:-1}" --pipeline "${E2E_PIPELINE:-1}" \
    --policies "${E2E_POLICIES:-fixed,fixed_5,fixed_3,mtp1,threshold,hardware_aware,draft_aware}" --cost-table "$OUT/cost_table_T$t.json" \
    --out "$OUT/e2e_T$t.json" 2>&1 | quiet | tail -80
done

stage "measured frontier"
for t in $temperatures; do
  timeout 60 python3 -m dspark.schedule mode=e2e e2e="$OUT/e2e_T$t.json" e2e_temperature=$t \
    out_dir="$WORK/frontier_T$t" hydra.run.dir="$WORK/hydra" 2>&1 | quiet | tail -8 &&
    cp "$WORK/frontier_T$t/fig7_frontier.png" "$OUT/fig7_T$t.png" &&
    cp "$WORK/frontier_T$t/fig7_frontier.json" "$OUT/fig7_T$t.json" &&
    cp "$WORK/frontier_T$t/fig8_budget.png" "$OUT/fig8_T$t.png" &&
    cp "$WORK/frontier_T$t/fig8_budget.json" "$OUT/fig8_T$t.json" &&
    cp "$WORK/frontier_T$t/fig_cost_check.png" "$OUT/cost_check_T$t.png" &&
    cp "$WORK/frontier_T$t/fig_cost_check.json" "$OUT/cost_check_T$t.json"
done
# SPEC_PROFILE="hardware_aware fixed_3 fixed" (policy names): where the host's time a round goes, each
# policy's rounds under cProfile at one temperature (SPEC_PROFILE_T, 1) and SPEC_PROFILE_R (16,64), priced
# by that temperature's table (python -m dspark.bench.round_profile; ~1-2 min a policy).
profile_t=${SPEC_PROFILE_T:-1}
for p in ${SPEC_PROFILE:-}; do
  stage "the host's work a round under cProfile, $p, T = $profile_t"
  timeout 180 python3 -m dspark.bench.round_profile $T --drafter-dir "$DRAFTER" --policy "$p" \
    --concurrency "${SPEC_PROFILE_R:-16,64}" --temperature "$profile_t" --cost-table "$OUT/cost_table_T$profile_t.json" \
    --out "$OUT/round_profile_$p.json" 2>&1 | quiet | tail -60
done
# One more e2e point at R and the first temperature (HOST_LOAD, PIPELINE_CHECK): e2e_point NAME R POLICIES FLAGS...
first_t=${temperatures%% *}
e2e_point() {
  local name=$1 r=$2 policies=$3
  shift 3
  timeout 300 python3 -m dspark.bench.e2e $T --drafter-dir "$DRAFTER" ${vocab[@]+"${vocab[@]}"} --benchmark gsm8k --prompts 32 \
    --concurrency "$r" --max-new-tokens 128 --temperature "$first_t" --repeats "${E2E_REPEATS:-3}" \
    --waves "${E2E_WAVES:-1}" --policies "$policies" --cost-table "$OUT/cost_table_T$first_t.json" \
    --out "$OUT/${name}_T$first_t.json" "$@" 2>&1 | quiet | tail -14
}
if [ -n "${HOST_LOAD:-}" ]; then
  read -r load_r load_us <<< "$HOST_LOAD"
  stage "host-bound check: R = $load_r, T = $first_t, $load_us µs of host load a round"  # ~1-2 min
  e2e_point host_load "$load_r" fixed_0 --host-load-us "$load_us"
fi
if [ -n "${PIPELINE_CHECK:-}" ]; then
  read -r pipe_r pipe_policies <<< "$PIPELINE_CHECK"
  stage "two rounds ahead: R = $pipe_r, T = $first_t, $pipe_policies"  # ~1-2 min
  e2e_point pipeline "$pipe_r" "$pipe_policies" --pipeline 2
fi
# The kernel benchmarks last: the e2e runs are what the study is for, and a machine can go back.
if [ "${SPEC_KERNELS:-1}" = 1 ]; then
  stage "the decoding kernels against what they replace"  # ~60 s: bias_argmax, nucleus, the LM head
  timeout 120 python3 -m dspark.bench.decode_kernels --out "$OUT/decode_kernels.json" 2>&1 | quiet | tail -12
  stage "one target layer: eager, all sizes symbolic, as the engine compiles it, per shape"  # ~1-2 min
  timeout 150 python3 -m dspark.bench.layer_compile --steps 1x8,256x1,256x8 --context "${ROUND_CONTEXT:-172}" \
    --out "$OUT/layer_compile.json" 2>&1 | quiet | tail -6
fi
stage "done"
