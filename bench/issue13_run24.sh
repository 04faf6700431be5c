#!/bin/bash
# Run 24 of issue 13, one device call (< 600 s), read-only: `hwtune bench --model hf-llama
# --judge-in-step` (the step judge at the patched model's own cache shapes, 2048 slots) on the card's
# table whose S 2048 entries no judge has run (H200: run 21's; H100: run 20's QR table), its ledger
# seeded, then the hf-llama rows (hf compiled, patched) on the table as given and as judged,
# alternating while DEADLINE_S (default 430 s) lasts. ORDER (default "given judged given judged")
# names the rows' tables in turn: given, judged, or prev (the card's table from before the fused
# norm + q|k|v + RoPE path: run 18's). Files under $OUT (4): run.log, judge-results.json (the judging
# bench's document), dispatch-judged.json, rows.json.
set -u -o pipefail
OUT=${OUT:?set OUT}; export COMMIT=${COMMIT:-unknown} PYTHONUNBUFFERED=1 HWTUNE_READ_ONLY=1 PYTHONPATH=$PWD
start=$SECONDS; left() { echo $(( ${DEADLINE_S:-430} - (SECONDS - start) )); }
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$name" in
  *H200*) given=bench/results/h200-issue13/run21/dispatch-judged.json
          ledger=bench/results/h200-issue13/run21/ledger.sqlite
          prev=bench/results/h200-issue13/run18/J32/dispatch-judged.json ;;
  *H100*) given=bench/results/h100-issue13/run20-qr/dispatch-judged.json
          ledger=bench/results/h100-issue13/run20-qr/ledger.sqlite
          prev=bench/results/h100-issue13/run18-wide/wide-judged.json ;;
  *) echo "no table for $name" > "$OUT/run.log"; exit 3 ;;
esac
ST=/tmp/r24-state W=/tmp/r24
rm -rf $ST $W; mkdir -p $ST $W/rows; cp "$ledger" $ST/ledger.sqlite; cp "$given" $W/judged.json
{ date; echo "commit $COMMIT card $name given $given"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,persistence_mode --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} > "$OUT/run.log" 2>&1
hf() {  # hf TABLE NAME TIMEOUT_S [ARGS]: the hf-llama rows on TABLE -> $W/rows/NAME.json
  local t=$1 n=$2 s=$3; shift 3
  echo "== $n on $t ($(left) s left) ==" >> "$OUT/run.log"
  timeout $s python3 -m daemon.cli --read-only --state-dir $ST bench --model hf-llama --layers 8 \
      --shapes 1x2048,32x2048 --variants hf-compiled,hf-hwtune --budget-s $((s - 10)) --steps 32 \
      --warmup 4 --check 4 --energy-window-s 0 --table "$t" "$@" --out $W/o >> "$OUT/run.log" 2>&1
  echo "$n rc=$?" >> "$OUT/run.log"
  cp $W/o/results.json "$W/rows/$n.json" 2>/dev/null; rm -rf $W/o "$t.lock"
}
hf $W/judged.json 1-judge-then-judged 270 --judge-in-step
cp $W/rows/1-judge-then-judged.json "$OUT/judge-results.json" 2>/dev/null
cp $W/judged.json "$OUT/dispatch-judged.json"
n=1
for which in ${ORDER:-given judged given judged}; do
  [ "$(left)" -gt 85 ] || break
  case $which in given) t=$given ;; prev) t=$prev ;; *) t=$W/judged.json ;; esac
  n=$((n + 1))
  hf "$t" "$n-$which" 80
done
python3 -c "import json, sys, pathlib; pathlib.Path(sys.argv[1]).write_text(json.dumps({pathlib.Path(f).stem: json.loads(pathlib.Path(f).read_text()) for f in sys.argv[2:]}))" \
    "$OUT/rows.json" $W/rows/*.json
echo "done ($(left) s left)" >> "$OUT/run.log"
ls -la "$OUT"
