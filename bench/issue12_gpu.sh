#!/bin/bash
# Issue 12's measurements on the lent H200, read-only (no GPU or host setting is changed).
#   bench/issue12_gpu.sh hf [TABLE]   hf-llama rows; without TABLE the decode shapes are searched first
#   bench/issue12_gpu.sh builtin TABLE  the built-in decoder's rows + GPU guard tests
# Writes at most 8 files under $OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1 HWTUNE_READ_ONLY=1
OUT=${OUT:-out/issue12}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then   # Liger Kernel (pure Python), carried as a wheel
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
ST=/tmp/hwtune-state
what=${1:-hf}; table=${2:-}
{ date -u; echo "commit ${COMMIT:-unknown}"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,persistence_mode --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  python3 -c "import liger_kernel; print('liger', liger_kernel.__file__)" 2>&1 | tail -1; } > "$OUT/env.txt" 2>&1
targ=(); [ -n "$table" ] && targ=(--table "$table")
if [ "$what" = hf ]; then
  [ -f bench/linear_gpu.py ] && timeout 100 python3 bench/linear_gpu.py > "$OUT/linear.txt" 2>&1
  timeout 480 python3 -m daemon.cli --read-only --state-dir $ST bench --model hf-llama --layers 8 \
      --shapes 1x2048,32x2048 --budget-s 460 --search-evals ${EVALS:-8} --steps 32 --warmup 4 --check 4 \
      "${targ[@]}" --out "$OUT/hf" > "$OUT/hf.log" 2>&1
  echo "bench rc=$?" >> "$OUT/hf.log"
else
  timeout 300 python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes 1x2048,32x2048 --budget-s 280 --search-evals ${EVALS:-8} "${targ[@]}" --out "$OUT/builtin" > "$OUT/builtin.log" 2>&1
  echo "bench rc=$?" >> "$OUT/builtin.log"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_verifier_guards.py > "$OUT/guards.txt" 2>&1
fi
cp $ST/dispatch/*.json "$OUT/dispatch.json" 2>/dev/null
ls -la "$OUT" "$OUT"/* | head -30
