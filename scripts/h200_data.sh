#!/usr/bin/env bash
# H200: data at engine speed (issue #17). Prepares N conversations (default 30000) with SmolLM2
# (or TARGET, a conf/target name whose GGUF is staged in /root/stage, e.g. gemma3_270m):
# self-generated prompts, then the target's answers, both decoded by the fast engine (static KV
# caches + CUDA graphs, data.engine=auto on CUDA), and prints conversations/min and answer tokens/s
# against the loop it replaced (1508 conversations/min, 6980 answer tokens/s; goal >= 5x, 30k
# conversations in <= 5 minutes). Needs /root/stage (../shared/GPU.md). Benchmark prompts for
# decontamination: BENCH_DIR if set, else ./bench if present, else the data config's default.
#   bash scripts/h200_data.sh                     # N=30000, bfloat16 target, fresh data dir
#   N=3000 DTYPE=float32 bash scripts/h200_data.sh
#   EXTRA="data.engine_compile=true data.gen_batch_size=512" bash scripts/h200_data.sh
#   TARGET=gemma3_270m DATA_EXTRA="data.source=jsonl data.jsonl.path=/root/stage/prompts.jsonl" bash scripts/h200_data.sh
#     (DATA_EXTRA: the recipe, which h200_drafter.sh train repeats; EXTRA: how it is built)
set -euo pipefail
export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -5
N=${N:-30000}
DTYPE=${DTYPE:-bfloat16}
R=outputs/h200/data
TARGET=${TARGET:-smollm2_135m}
DIR=$R/${DATA_NAME:-${TARGET%%_*}_${N}_${DTYPE}}
mkdir -p $R
BENCH=()
if [ -n "${BENCH_DIR:-}" ]; then BENCH=(data.benchmark_dir="$BENCH_DIR")
elif [ -d bench ]; then BENCH=(data.benchmark_dir=bench); fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/machine.txt
# The graph path against its eager twin (top-k / top-p inside the graphs) and the Triton kernels
# against their PyTorch references, before the timed run (SKIP_GPU_TESTS=1: the caller runs them).
if [ -z "${SKIP_GPU_TESTS:-}" ]; then
  bash scripts/h200_gpu_tests.sh $R/gpu_tests.log ||
    echo "GPU TESTS FAILED (see $R/gpu_tests.log): the timings below are of a path that differs from its reference"
fi
# force=true: a fresh build, so the timings are this run's (a plain rerun would resume instead).
LOG=$R/prepare_$N.log
if ! python3 -m dspark.prepare target=$TARGET target.path=/root/stage target.device=cuda \
  target.dtype=$DTYPE data=full data.num_prompts=$N data.dir=$DIR force=true ${BENCH[@]+"${BENCH[@]}"} \
  hydra.run.dir=$R/prepare_$N ${DATA_EXTRA:-} ${EXTRA:-} > $LOG 2>&1; then
  tr '\r' '\n' < $LOG | tail -30
  exit 1
fi
tr '\r' '\n' < $LOG | grep -a "concurrency\|WARNING\|dataset ready" | tail -6 || true
python3 - "$DIR/DONE.json" <<'EOF' | tee $R/summary_$N.txt
import json, sys

d = json.load(open(sys.argv[1]))
t, g = d["timings"], d["generation"]
p, a = g["prompts"], g["answers"]
gen_s = t["prompts_s"] + t["answers_s"]
conv_min, tok_s = d["rate"]["conversations_per_min"], d["rate"]["answer_tokens_per_s"]
print(f"target {d['target']['name']} {d['target']['dtype']} on {d['device']}")
print(f"prompts: {p.get('engine')} engine, concurrency {p.get('concurrency')}, {p.get('tokens')} tokens "
      f"({p.get('decode_s', 0):.1f} s decoding) in {t['prompts_s']:.1f} s")
print(f"answers: {a['engine']} engine, concurrency {a['concurrency']}, compile={a['compile']}, "
      f"{a['answer_tokens']} tokens in {t['answers_s']:.1f} s")
r = a.get("rounds") or {}
if r:  # the device's work against the host's per decode round: which one sets the pace
    print(f"answer rounds: {r['rounds']}, {r['ms_per_round']} ms each on the device's timeline, "
          f"{r['gpu_ms_per_round']} ms of device work, {r['host_ms_per_round']} ms of host work")
print(f"{a['conversations']} conversations in {gen_s:.1f} s (prompts + answers; goal: 30000 in <= 300 s)")
print(f"conversations/min {conv_min}  ({conv_min / 1508:.1f}x the 1508 of the old loop; goal >= 5x)")
print(f"answer tokens/s   {tok_s}  ({tok_s / 6980:.1f}x the 6980 of the old loop)")
EOF
# What the target's sampling filter costs a round of that many rows (top-p: kernels.nucleus on CUDA,
# the sort of the whole vocabulary it replaced as well), against the plain softmax: the share of a
# round above.
python3 - "$DIR/DONE.json" <<'EOF' | tee -a $R/summary_$N.txt
import json, sys

import torch

from dspark.decoding.sampling import target_probs
from dspark.kernels.nucleus import nucleus_reference

d = json.load(open(sys.argv[1]))
rows = d["generation"]["answers"]["concurrency"] or 1
gen = d["config"]["target"].get("generation") or {}  # the answers' sampling
t, top_p = float(gen.get("temperature", 1.0)) or 1.0, float(gen.get("top_p", 1.0))
logits = torch.randn(rows, int(d["target"]["vocab_size"]), device="cuda") * 4


def median_ms(fn, n=20):
    fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[n // 2]


full = median_ms(lambda: target_probs(logits, t, top_p=top_p, static=True))
plain = median_ms(lambda: target_probs(logits, t, static=True))
sort = median_ms(lambda: nucleus_reference(target_probs(logits, t, static=True), top_p))
print(f"sampling filter at {rows} rows: T={t} top-p={top_p} {full:.2f} ms, softmax alone {plain:.2f} ms, "
      f"with the sort-based top-p {sort:.2f} ms")
EOF
