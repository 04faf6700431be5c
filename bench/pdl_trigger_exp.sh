#!/bin/bash
# Where should a kernel let the next one launch (HWTUNE_PDL_TRIGGER)? On the lent H200,
# read-only: the GPU test of PDL, then the built-in 8-layer decode step (tuned-nopdl and tuned,
# batch 1 and 32) once per trigger placement -- none, after-wait, first, none again (the repeat
# is the run-to-run spread). TABLE defaults to run 10's dispatch table. Writes $OUT/run.log and
# one results file per run (b-<n>-<trigger>.json).
set -u
export PYTHONUNBUFFERED=1 HWTUNE_READ_ONLY=1 PYTHONPATH=$PWD
OUT=${OUT:-out/pdl-trigger}; mkdir -p "$OUT"
T=${1:-bench/results/h200-issue13/run10/dispatch.json}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,persistence_mode --format=csv; } > $OUT/run.log 2>&1
timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py >> $OUT/run.log 2>&1; echo "pdl test rc=$?" >> $OUT/run.log
n=0
for t in none after-wait first none; do
  n=$((n + 1))
  HWTUNE_PDL_TRIGGER=$t timeout 150 python3 -m daemon.cli --read-only --state-dir /tmp/st bench --model builtin --layers 8 \
      --shapes 1x2048,32x2048 --variants tuned-nopdl,tuned --budget-s 120 --energy-window-s 0 --table $T --out $OUT/b >> $OUT/run.log 2>&1
  echo "trigger $t rc=$?" >> $OUT/run.log
  cp $OUT/b/results.json $OUT/b-$n-$t.json; rm -rf $OUT/b
done
grep -E "decode |trigger|rc=|passed|failed" $OUT/run.log
