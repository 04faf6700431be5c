#!/bin/bash
# The stream-K O projection, measured (read-only; no GPU or host setting is changed):
#   bench/experiments/streamk_gpu.sh
# searches bench/experiments/linear_residual_streamk.py (through the harness: verified, timed
# against stock) at the batch-32 linear_residual shapes into a fresh table, puts its entries into
# a copy of this device's judged table (H200: run 14 U's, H100: run 16 C's), then times the
# built-in rows on the given table and on that copy, alternating three times. At most 8 files
# under $OUT.
. bench/experiments/common.sh streamk
case "$name" in
  *H200*) given=bench/results/h200-issue13/run14/U/dispatch-judged.json ;;
  *) given=bench/results/h100-issue13/run16/C/judged32.json ;;
esac
cp "$given" "$OUT/given.json"
timeout ${SEARCH_S:-150} python3 -m daemon.cli --read-only --state-dir $ST search linear_residual \
    --source bench/experiments/linear_residual_streamk.py --device cuda --dtype bfloat16 \
    --shape M=32,K=4096,N=4096 --shape M=32,K=14336,N=4096 --budget all \
    --dispatch-out "$OUT/streamk.json" > $ST/search.log 2>&1
echo "search rc=$?"; tail -14 $ST/search.log
python3 bench/experiments/merge_entries.py "$OUT/given.json" "$OUT/streamk.json" "$OUT/new.json" stream-K
for n in 1 2 3; do
  rows "$OUT/given.json" 1x2048,32x2048 $n-given
  rows "$OUT/new.json" 1x2048,32x2048 $n-new
done
merge_json "$OUT/rows.json" $ST/rows-*.json
cp $ST/search.log "$OUT/search.log"
