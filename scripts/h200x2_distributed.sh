#!/usr/bin/env bash
# Two H200s (device kind nvidia-h200-x2), issue 11: DDP scaling and loss parity.
# The same short DSpark training on 1 GPU and on 2 GPUs (Lightning DDP) with the same global batch
# (1 GPU: data.batch_size per micro-batch, accumulation 2; 2 GPUs: the same micro-batch on each,
# no accumulation), so both see the same samples and anchors in every optimizer step.
# Writes outputs/h200/distributed.json (steady-state samples/s of each, scaling ratio, loss curves,
# max |loss difference|, commands, commit, machine) and copies it with the logs to $OUT when set.
#
# Needs the SmolLM2 GGUF and the hydra/omegaconf/antlr/gguf wheels staged under /root/stage first
# (as for scripts/h200_stage1.sh). Then, from the repository root:
#     bash scripts/h200x2_distributed.sh          # about 6 minutes on 2 H200s
# Knobs (environment): STEPS=150 PER_DEVICE=8 GLOBAL_BATCH=16 NUM_PROMPTS=1200, WARMUP=5 (optimizer
# steps left out of samples/s), MAX_TIME=00:00:02:30 (a safety stop per training run, so the script
# stays under 8 minutes), COMMIT (recorded when .git is not there). SMOKE=1 runs the same script on
# the CPU (tiny target, 2 gloo processes, 4 steps) to check it end to end without a GPU.
# Budget on 2 H200s: install ~10 s, prepare ~90 s (~1000 conversations/min), 1 GPU ~150 s
# (300 micro-batches), 2 GPUs ~90 s, each run with ~20 s of start-up.
set -euo pipefail
cd "$(dirname "$0")/.."
# Never NVLink multicast on the shared hosts (KINDS.md); Lightning's launcher passes these on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
O=outputs/h200/distributed
rm -rf "$O"
mkdir -p "$O"
START=$(date +%s)
bring_back() {  # with $OUT set (the device tool), the result and the logs go there, also on failure
  if [[ -n "${OUT:-}" ]]; then
    [[ -f outputs/h200/distributed.json ]] && cp outputs/h200/distributed.json "$OUT/"
    tar czf "$OUT/distributed_logs.tgz" --exclude='*.safetensors' --exclude='*.ckpt' --exclude='data' "$O" || true
    ls -la "$OUT"
  fi
}
trap bring_back EXIT
rm -f outputs/h200/distributed.json

if [[ "${SMOKE:-0}" == 1 ]]; then
  PY=${PY:-.venv/bin/python}
  export OMP_NUM_THREADS=1
  WARMUP=${WARMUP:-1} STEPS=${STEPS:-4} PER_DEVICE=${PER_DEVICE:-2} GLOBAL_BATCH=${GLOBAL_BATCH:-4} MAX_TIME=${MAX_TIME:-00:00:05:00}
  T="target=tiny"
  DATA="data=smoke data.dir=$O/data data.num_prompts=12 data.max_new_tokens=12 data.val_fraction=0.25"
  EXTRA="drafter.num_layers=1 head.rank=32"
  ONE="trainer=cpu trainer.devices=1"
  TWO="trainer=ddp trainer.accelerator=cpu trainer.devices=2 trainer.precision=32-true"
else
  PY=${PY:-python3}
  export PYTHONPATH=/root/stage/site:${PYTHONPATH:-}
  WARMUP=${WARMUP:-5} STEPS=${STEPS:-150} PER_DEVICE=${PER_DEVICE:-8} GLOBAL_BATCH=${GLOBAL_BATCH:-16} MAX_TIME=${MAX_TIME:-00:00:02:30}
  NUM_PROMPTS=${NUM_PROMPTS:-1200}
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$O/install.log" 2>&1 ||
    { tail -30 "$O/install.log"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$O/machine.txt"
  GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  [[ "$GPUS" -ge 2 ]] || { echo "needs 2 GPUs, torch sees $GPUS" >&2; exit 1; }
  T="target=smollm2_135m target.path=/root/stage target.device=cuda"
  DATA="data=full data.dir=data/smollm2_135m/distributed data.num_prompts=$NUM_PROMPTS data.max_length=1024"
  DATA="$DATA data.anchors_per_sequence=128"
  ONE="trainer=gpu trainer.devices=1"
  TWO="trainer=ddp trainer.devices=2"
  EXTRA=""
fi

# Training only: no validation, no calibration, no intermediate checkpoints, no resume.
RUN="data.batch_size=$PER_DEVICE data.global_batch_size=$GLOBAL_BATCH trainer.max_steps=$STEPS"
RUN="$RUN trainer.max_time=$MAX_TIME trainer.limit_val_batches=0 trainer.num_sanity_val_steps=0"
RUN="$RUN trainer.log_every_n_steps=1 callbacks.checkpoint_every_n_steps=1000000 callbacks.calibration=false"
RUN="$RUN callbacks.throughput_warmup_steps=$WARMUP resume=false seed=0 drafter=dspark $EXTRA"

step() {  # name, command...: run with the output in $O/<name>.log, show its tail if it fails
  local name=$1
  shift
  echo "[$(date +%T)] $name: $*"
  local t0
  t0=$(date +%s%N)
  if ! "$@" >"$O/$name.log" 2>&1; then
    echo "$name failed; the end of $O/$name.log:" >&2
    tail -60 "$O/$name.log" >&2
    exit 1
  fi
  echo "$name $((($(date +%s%N) - t0) / 1000000))" >>"$O/wall_ms.txt"
}

PREPARE="$PY -m dspark.prepare $T $DATA hydra.run.dir=$O/prepare"
TRAIN1="$PY -m dspark.train $T $DATA $RUN $ONE hydra.run.dir=$O/gpu1"
TRAIN2="$PY -m dspark.train $T $DATA $RUN $TWO hydra.run.dir=$O/gpu2"
step prepare $PREPARE
step train_1gpu $TRAIN1
step train_2gpu $TRAIN2

COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
DIRTY=$(git status --porcelain --untracked-files=no 2>/dev/null | head -c 1 | wc -c || echo 0)
export O COMMIT DIRTY PREPARE TRAIN1 TRAIN2 STEPS PER_DEVICE GLOBAL_BATCH START SMOKE="${SMOKE:-0}"
"$PY" - <<'EOF'
import csv, json, os, platform, time
from pathlib import Path

O = Path(os.environ["O"])


def curve(run):
    rows = list(csv.DictReader(open(O / run / "logs" / "metrics.csv")))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def run_info(run, command):
    s = json.loads((O / run / "summary.json").read_text())
    tp = s["throughput"]
    return {
        "command": command,
        "strategy": s["strategy"],
        "batch": s["batch"],
        "global_step": s["global_step"],
        "fit_seconds": s["wall_seconds"],
        "samples_per_s": tp["steady"]["samples_per_s"],
        "tokens_per_s": tp["steady"]["tokens_per_s"],
        "steady": tp["steady"],
        "samples_per_s_incl_warmup": tp["samples_per_s"],
        "samples": tp.get("global_samples"),
    }


one, two = curve("gpu1"), curve("gpu2")
common = sorted(set(one) & set(two))
diffs = [abs(one[s] - two[s]) for s in common]
r1 = run_info("gpu1", os.environ["TRAIN1"])
r2 = run_info("gpu2", os.environ["TRAIN2"])
walls = dict(line.split() for line in (O / "wall_ms.txt").read_text().splitlines())
machine = (O / "machine.txt").read_text().strip().splitlines() if (O / "machine.txt").exists() else [platform.node()]
ratio = r2["samples_per_s"] / r1["samples_per_s"] if r1["samples_per_s"] and r2["samples_per_s"] else None
out = {
    "what": "the same DSpark training on 1 GPU and on 2 GPUs (Lightning DDP), same global batch "
    "(1 GPU accumulates 2 micro-batches, 2 GPUs take one each): throughput and loss parity",
    "smoke_cpu_dry_run": os.environ["SMOKE"] == "1",
    "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    "commit": os.environ["COMMIT"],
    "working_tree_dirty": os.environ["DIRTY"].strip() not in ("", "0"),
    "machine": machine,
    "steps": int(os.environ["STEPS"]),
    "per_device_batch": int(os.environ["PER_DEVICE"]),
    "global_batch": int(os.environ["GLOBAL_BATCH"]),
    "throughput_note": "samples/s over all ranks after the first warmup_steps optimizer steps "
    "(Throughput callback; validation off)",
    "runs": {"1gpu": r1, "2gpu": r2},
    "scaling": {"samples_per_s_ratio": ratio, "goal": 1.8, "meets_goal": ratio is not None and ratio >= 1.8},
    "loss_parity": {
        "steps_compared": len(common),
        "max_abs_diff": max(diffs) if diffs else None,
        "mean_abs_diff": sum(diffs) / len(diffs) if diffs else None,
        "first_step_abs_diff": diffs[0] if diffs else None,
        "max_abs_diff_first_10_steps": max(diffs[:10]) if diffs else None,
    },
    "loss_curves": {"1gpu": [[s, one[s]] for s in sorted(one)], "2gpu": [[s, two[s]] for s in sorted(two)]},
    "script": "bash scripts/h200x2_distributed.sh"
    + "".join(f" {k}={os.environ[k]}" for k in ("STEPS", "PER_DEVICE", "GLOBAL_BATCH") if k in os.environ),
    "commands": {"prepare": os.environ["PREPARE"], "train_1gpu": os.environ["TRAIN1"], "train_2gpu": os.environ["TRAIN2"]},
    "wall_seconds": {**{k: int(v) / 1000 for k, v in walls.items()}, "script": time.time() - int(os.environ["START"])},
}
(O.parent / "distributed.json").write_text(json.dumps(out, indent=2))
print(json.dumps({k: out[k] for k in ("scaling", "loss_parity")}, indent=2))
print({k: (v["samples_per_s"], v["global_step"]) for k, v in out["runs"].items()})
EOF
echo "wrote outputs/h200/distributed.json in $(($(date +%s) - START)) s"
