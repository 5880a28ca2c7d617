#!/usr/bin/env bash
# H200: the GPU tests that hold the fast paths to their references (the Triton kernels: fused loss,
# sampling, rejection, cache attention, the greedy bias argmax, top-p; the fast engine's CUDA
# graphs, compiled layers, rounds without host syncs; the training step's flex block mask against
# the dense one; validation's STS fit on the GPU against the CPU's; the training target's CUDA
# graphs against its forward), a line per test as it ends, then the summary, in LOG (default
# outputs/h200/gpu_tests.log). Exits with pytest's status (124 when LIMIT seconds, default 540, ran
# out: the log keeps what ran; the whole set took 259 s alone on 2026-12-03, before the draft
# vocabulary's engine checks, which compile four drafters more; 304 s beside a data stage on
# 2026-12-07, 91 tests). Called by h200_data.sh before it times the data, and by h200_session.sh's
# gputests stage when the data comes from a pack.
set -uo pipefail
export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
LOG=${1:-outputs/h200/gpu_tests.log}
mkdir -p "$(dirname "$LOG")"
timeout "${LIMIT:-540}" python3 -m pytest -p no:cacheprovider -m gpu -v -rA tests/test_fast_engine.py tests/test_drafters.py \
  tests/test_kernels.py tests/test_draft_vocab.py tests/test_calibration.py tests/test_feature_graphs.py 2>&1 |
  tee "$LOG" | tail -3
