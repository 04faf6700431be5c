#!/bin/bash
# One device call (< 600 s), read-only: on an H200, issue 13's owed run 25 (bench/issue13_run25.sh);
# on any other card, the checks that the GPU path still works after CPU-side changes (not timings):
#   1. pytest -m gpu tests/                     -> $OUT/gpu-tests.txt
#   2. bench/harness_gpu.py --quick             -> $OUT/harness-gpu.txt (honest accepted, hostile refused)
#   3. the hf-llama rows (hf compiled, hwtune patched) on the H100's run-25 judged table, so that a
#      patched model that silently ran stock would show as a ~1.0x row -> $OUT/hf-rows.txt
set -u -o pipefail
OUT=${OUT:?set OUT}; export COMMIT=${COMMIT:-unknown} PYTHONUNBUFFERED=1 HWTUNE_READ_ONLY=1 PYTHONPATH=$PWD
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name commit $COMMIT"
case "$name" in *H200*) DEADLINE_S=540 exec bench/issue13_run25.sh ;; esac
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > "$OUT/gpu-tests.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu-tests.txt"; tail -4 "$OUT/gpu-tests.txt"
mkdir -p /tmp/hg
OUT=/tmp/hg timeout 200 python3 bench/harness_gpu.py --quick > "$OUT/harness-gpu.txt" 2>&1
echo "harness_gpu rc=$?" >> "$OUT/harness-gpu.txt"; tail -25 "$OUT/harness-gpu.txt"
table=bench/results/h100-issue13/run25/dispatch-judged.json
rm -rf /tmp/gc-state /tmp/gc-o; cp "$table" /tmp/gc-table.json
timeout 150 python3 -m daemon.cli --read-only --state-dir /tmp/gc-state bench --model hf-llama --layers 8 \
    --shapes 1x2048,32x2048 --variants hf-compiled,hf-hwtune --budget-s 140 --steps 32 --warmup 4 --check 4 \
    --energy-window-s 0 --table /tmp/gc-table.json --out /tmp/gc-o > "$OUT/hf-rows.txt" 2>&1
echo "hf rows rc=$?" >> "$OUT/hf-rows.txt"; tail -25 "$OUT/hf-rows.txt"
