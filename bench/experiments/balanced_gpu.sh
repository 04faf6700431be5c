#!/bin/bash
# The balanced-grid gate/up, and a wider batch-1 judge, measured (read-only; no GPU or host
# setting is changed):
#   bench/experiments/balanced_gpu.sh
# 1. searches the candidate of bench/experiments/rmsnorm_gate_up_swiglu_balanced.patch through the harness (verified,
#    timed against stock) at the batch-32 gate/up shape into a fresh table, puts its entry into a
#    copy of this device's judged table (H200: run 18 J32's, H100: run 16 C's), judges that copy's
#    batch-32 step with 8 configs an entry (so the balanced configs meet each other in the step),
#    then times the batch-32 rows on the given table and on the judged copy, alternating three times;
# 2. (WIDE=0 skips it) judges a copy of the given table's batch-1 step with 32 configs an entry:
#    on an H200 from run 14 U's ledger (its 40 rope_kv_attention configs and Q's projection
#    configs), elsewhere from a fresh ledger of rope_kv_attention searched at batch 1 (40 configs),
#    then the batch-1 rows on the given table and that copy, alternating twice.
# BAL=0 skips part 1.
# At most 8 files under $OUT.
. bench/experiments/common.sh balanced
case "$name" in
  *H200*) given=bench/results/h200-issue13/run18/J32/dispatch-judged.json; h200=1 ;;
  *) given=bench/results/h100-issue13/run16/C/judged32.json; h200=0 ;;
esac
cp "$given" $ST/given.json
if [ "${BAL:-1}" = 1 ]; then
cand=$(candidate rmsnorm_gate_up_swiglu_balanced) || exit 1
timeout 150 python3 -m daemon.cli --read-only --state-dir $ST search rmsnorm_gate_up_swiglu \
    --source $cand --device cuda --dtype bfloat16 \
    --shape M=32,K=4096,I=14336 --budget all --dispatch-out $ST/balanced.json > $ST/search.log 2>&1
echo "search rc=$?"; tail -14 $ST/search.log
python3 bench/experiments/merge_entries.py $ST/given.json $ST/balanced.json $ST/new.json balanced
judge $ST/new.json 32x2048 8 $ST/judge32.json
for n in 1 2 3; do
  rows $ST/given.json 32x2048 b32-$n-given
  rows $ST/new.json 32x2048 b32-$n-balanced
done
fi
if [ "${WIDE:-1}" = 1 ]; then
  if [ "$h200" = 1 ]; then
    cp bench/results/h200-issue13/run14/U/ledger.sqlite $ST/ledger.sqlite
  else
    timeout 130 python3 bench/search_decode.py --state-dir $ST --shapes 1x2048 \
        --kernels rope_kv_attention --budget-s 110 --evals 40 > $ST/attn-search.log 2>&1
    echo "attention search rc=$?"; tail -4 $ST/attn-search.log; cp $ST/attn-search.log "$OUT/"
  fi
  cp $ST/given.json $ST/wide.json
  judge $ST/wide.json 1x2048 32 $ST/judge1.json
  for n in 1 2; do
    rows $ST/given.json 1x2048 b1-$n-given
    rows $ST/wide.json 1x2048 b1-$n-wide
  done
  cp $ST/wide.json "$OUT/wide-judged.json"
fi
merge_json "$OUT/rows.json" $ST/rows-*.json $ST/judge*.json
if [ -f $ST/search.log ]; then cp $ST/search.log "$OUT/search.log"; fi
if [ -f $ST/new.json ]; then cp $ST/new.json "$OUT/balanced-judged.json"; fi
