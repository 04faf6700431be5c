#!/bin/bash
# Issue 13's measurements on the lent H200, read-only (no GPU or host setting is changed).
#   bench/issue13_gpu.sh search          search one dispatch table for both models' decode calls
#                                        (fused and unfused, batch 1 and 32): $OUT/dispatch.json
#   bench/issue13_gpu.sh bench TABLE     built-in rows (graphed, compile, tuned-unfused, tuned) and
#                                        hf-llama rows (eager, compiled, hwtune-unfused, hwtune)
#   bench/issue13_gpu.sh gaps TABLE      the built-in step's gap breakdown + GPU tests
#   bench/issue13_gpu.sh A               search (decode attention deeper first), then the hf-llama
#                                        rows on that table
#   bench/issue13_gpu.sh B TABLE         the built-in rows (no compile row), the gap breakdown, GPU tests
# Writes at most 8 files under $OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1 HWTUNE_READ_ONLY=1
OUT=${OUT:-out/issue13}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
ST=/tmp/hwtune-state
what=${1:-search}; table=${2:-}
{ date -u; echo "commit ${COMMIT:-unknown} mode $what"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,persistence_mode --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > "$OUT/env.txt" 2>&1
hf_rows() {
  timeout ${HF_S:-320} python3 -m daemon.cli --read-only --state-dir $ST bench --model hf-llama --layers 8 \
      --shapes 1x2048,32x2048 --variants hf-eager,hf-compiled,hf-hwtune-unfused,hf-hwtune --budget-s 300 \
      --steps 32 --warmup 4 --check 4 --energy-window-s 2 --table "$1" --out "$OUT/hf" > "$OUT/hf.log" 2>&1
  echo "bench rc=$?" >> "$OUT/hf.log"
  cp "$OUT/hf/results.json" "$OUT/hf-results.json" 2>/dev/null; rm -rf "$OUT/hf"
}
case "$what" in
A)
  # decode attention first, deeper (its grid is twice the size with REDUCE), then every other call
  timeout ${ATTN_S:-120} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels decode_attention --budget-s ${ATTN_BUDGET:-100} --evals ${ATTN_EVALS:-40} \
      --json "$OUT/search-attention.json" > "$OUT/search.log" 2>&1
  echo "attention search rc=$?" >> "$OUT/search.log"
  timeout ${SEARCH_S:-300} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --budget-s ${BUDGET:-260} --evals ${EVALS:-14} --json "$OUT/search.json" >> "$OUT/search.log" 2>&1
  echo "search rc=$?" >> "$OUT/search.log"
  cp $ST/dispatch/*.json "$OUT/dispatch.json" 2>/dev/null
  hf_rows "$OUT/dispatch.json" ;;
B)
  timeout 200 python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes 1x2048,32x2048 --variants graphed,tuned-unfused,tuned --budget-s 180 \
      --energy-window-s 2 --table "$table" --out "$OUT/builtin" > "$OUT/builtin.log" 2>&1
  echo "bench rc=$?" >> "$OUT/builtin.log"
  cp "$OUT/builtin/results.json" "$OUT/builtin-results.json" 2>/dev/null; rm -rf "$OUT/builtin"
  timeout 200 python3 bench/gaps_gpu.py --table "$table" --shapes 1x2048,32x2048 --out "$OUT" > "$OUT/gaps.log" 2>&1
  echo "gaps rc=$?" >> "$OUT/gaps.log"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_verifier_guards.py tests/test_gaps.py > "$OUT/gputests.txt" 2>&1
  timeout 100 python3 -m pytest -q -p no:cacheprovider -k "ptx or PTX" tests/test_kernel_linear_residual.py \
      tests/test_kernel_rmsnorm_linear.py tests/test_kernel_rmsnorm_gate_up_swiglu.py tests/test_linear_gemv.py >> "$OUT/gputests.txt" 2>&1 ;;
search)
  timeout ${SEARCH_S:-540} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --budget-s ${BUDGET:-480} --evals ${EVALS:-6} --json "$OUT/search.json" > "$OUT/search.log" 2>&1
  echo "search rc=$?" >> "$OUT/search.log"
  cp $ST/dispatch/*.json "$OUT/dispatch.json" 2>/dev/null ;;
bench)
  timeout 260 python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes 1x2048,32x2048 --variants graphed,compile,tuned-unfused,tuned --budget-s 240 \
      --energy-window-s 2 --table "$table" --out "$OUT/builtin" > "$OUT/builtin.log" 2>&1
  echo "bench rc=$?" >> "$OUT/builtin.log"
  timeout ${HF_S:-320} python3 -m daemon.cli --read-only --state-dir $ST bench --model hf-llama --layers 8 \
      --shapes 1x2048,32x2048 --variants hf-eager,hf-compiled,hf-hwtune-unfused,hf-hwtune --budget-s 300 \
      --steps 32 --warmup 4 --check 4 --energy-window-s 2 --table "$table" --out "$OUT/hf" > "$OUT/hf.log" 2>&1
  echo "bench rc=$?" >> "$OUT/hf.log"
  for m in builtin hf; do cp "$OUT/$m/results.json" "$OUT/$m-results.json" 2>/dev/null; rm -rf "$OUT/$m"; done ;;
gaps)
  timeout 300 python3 bench/gaps_gpu.py --table "$table" --shapes 1x2048,32x2048 --out "$OUT" > "$OUT/gaps.log" 2>&1
  echo "gaps rc=$?" >> "$OUT/gaps.log"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_verifier_guards.py tests/test_gaps.py > "$OUT/gputests.txt" 2>&1
  timeout 150 python3 -m pytest -q -p no:cacheprovider -k "ptx or PTX" tests/test_kernel_linear_residual.py \
      tests/test_kernel_rmsnorm_linear.py tests/test_kernel_rmsnorm_gate_up_swiglu.py tests/test_linear_gemv.py >> "$OUT/gputests.txt" 2>&1 ;;
esac
ls -la "$OUT" | head -20
