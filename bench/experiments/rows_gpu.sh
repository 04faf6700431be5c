#!/bin/bash
# The "rows" projection variant (whole weight rows a program, all of K in one load) at batch 1,
# measured in the step (read-only; no GPU or host setting is changed):
#   [CANDIDATE=FILE KERNEL=linear_residual SHAPES="M=1,N=4096,K=4096 M=1,N=4096,K=14336"] \
#     bench/experiments/rows_gpu.sh
# searches CANDIDATE (a file; default: the candidate of bench/experiments/linear_residual_rows.patch,
# the linear_residual template with the rows variant added, every config) through the harness
# at SHAPES into a fresh table, puts its entries into a copy of this device's table (H200: run 18
# J32's, H100: run 18's wide-judged one), judges that copy's batch-1 step (8 configs an entry:
# rows and the template's own gemv configs meet in the step), then times the batch-1 rows on the
# given table and the judged copy, alternating ROUNDS times (default 2), and the judged copy once
# more with HWTUNE_PDL_EARLY=1 (the rows kernel's whole weight tile is its early prefix).
# At most 8 files under $OUT.
. bench/experiments/common.sh rows
case "$name" in
  *H200*) given=bench/results/h200-issue13/run18/J32/dispatch-judged.json ;;
  *) given=bench/results/h100-issue13/run18-wide/wide-judged.json ;;
esac
cp "$given" $ST/given.json
kernel=${KERNEL:-linear_residual}
cand=${CANDIDATE:-$(candidate linear_residual_rows)} || exit 1
shape_args=$(for s in ${SHAPES:-M=1,N=4096,K=4096 M=1,N=4096,K=14336}; do printf -- '--shape %s ' "$s"; done)
timeout ${SEARCH_S:-200} python3 -m daemon.cli --read-only --state-dir $ST search $kernel \
    --source $cand --device cuda --dtype bfloat16 \
    $shape_args --budget all --dispatch-out $ST/found.json > $ST/search.log 2>&1
echo "search rc=$?"; grep -E '^\[|^shape|^[MB]=' $ST/search.log | cut -c1-220 | tail -60
python3 bench/experiments/merge_entries.py $ST/given.json $ST/found.json $ST/new.json rows
judge $ST/new.json 1x2048 8 $ST/judge1.json
for n in $(seq 1 ${ROUNDS:-2}); do
  rows $ST/given.json 1x2048 b1-$n-given
  rows $ST/new.json 1x2048 b1-$n-new
done
HWTUNE_PDL_EARLY=1 rows $ST/new.json 1x2048 b1-early-new
merge_json "$OUT/rows.json" $ST/rows-*.json $ST/judge1.json
cp $ST/search.log "$OUT/search.log"; cp $ST/new.json "$OUT/rows-judged.json"
