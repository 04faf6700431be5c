#!/usr/bin/env bash
# bench/hf_rows_exp.sh TABLE BEFORE_PY: the patched transformers model's rows (hf-llama, batch 1
# and 32, context 2048) with the working tree's integration, with BEFORE_PY in its place, and
# with the working tree's again (one machine, alternating: run-to-run spread across machines is
# larger than the change), then bench/hf_gaps_gpu.py's breakdown of the working tree's patched
# step. Read-only: every bench runs with --read-only. Writes to $OUT (at most 8 files).
set -u
table=$1; before=$2
ST=$(mktemp -d)
now=kernelsearch/integrations/transformers.py
keep=$(mktemp); cp "$now" "$keep"
trap 'cp "$keep" "$now"' EXIT   # the working tree's integration back, however the script ends
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,persistence_mode --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > "$OUT/env.txt" 2>&1
rows() {  # rows NAME: hf eager (the reference) and hf-hwtune on TABLE -> $OUT/hf-NAME.json
  timeout 150 python3 -m daemon.cli --read-only --state-dir $ST bench --model hf-llama --layers 8 \
      --shapes 1x2048,32x2048 --variants hf-eager,hf-hwtune --budget-s 140 \
      --steps 32 --warmup 4 --check 4 --energy-window-s 0 --table "$table" --out "$OUT/hf" >> "$OUT/log.txt" 2>&1
  echo "$1 bench rc=$?" >> "$OUT/log.txt"
  cp "$OUT/hf/results.json" "$OUT/hf-$1.json"; rm -rf "$OUT/hf"
}
rows after1
cp "$before" "$now"; rows before; cp "$keep" "$now"
rows after2
PYTHONPATH=. timeout 150 python3 bench/hf_gaps_gpu.py --short-lowering-errors --table "$table" \
    --shapes 1x2048,32x2048 --variants hf-hwtune --out "$OUT" >> "$OUT/log.txt" 2>&1
echo "gaps rc=$?" >> "$OUT/log.txt"
grep -h "hf-llama hf-hwtune \|rc=" "$OUT/log.txt"
