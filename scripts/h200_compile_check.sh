#!/usr/bin/env bash
# H200: the fast engine's target step with torch.compile'd layer functions (issue 8 follow-up):
# the compiled == eager GPU test, then SPS(B) of the graph path with --compile (HF column skipped;
# it is in docs/results/engine_sps.json). Needs /root/stage (the GGUF and wheels staged beforehand).
set -euo pipefail
export PYTHONPATH=/root/stage/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export DSPARK_COMMIT=${DSPARK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -5 || true
R=outputs/h200/compile
mkdir -p $R
timeout 120 python3 -m pytest -p no:cacheprovider -m gpu tests/test_fast_engine.py 2>&1 | tee $R/gpu_tests.log | tail -5 || true
python3 -m dspark.bench.engine_sps target=smollm2_135m target.path=/root/stage target.device=cuda \
  target.dtype=bfloat16 --context 512 --no-hf --compile --tokens ${TOKENS:-1,8,64,256,2048} --repeats 20 \
  --out $R/engine_sps_compiled.json 2>&1 | tee $R/engine_sps_compiled.log | grep -v Loading | tail -12
