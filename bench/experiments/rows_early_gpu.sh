#!/bin/bash
# The "rows" O projection (the candidate of bench/experiments/linear_residual_rows.patch, with its
# BLOCK_N 1, 4-warp config alone) in the batch-1 step, with and without early reads (read-only;
# no GPU or host setting is changed): bench/experiments/rows_early_gpu.sh
# The rows kernel's early prefix is its whole weight tile, so with HWTUNE_PDL_EARLY=1 every
# resident O program loads all of its weight before it waits for the attention ahead. The script
# searches that one config at the O shape (4096 x 4096, batch 1) into a fresh table, puts the
# entry into a copy of the H200's run 18 J32 table, then times the batch-1 rows of the given table
# and the copy, each with HWTUNE_PDL_EARLY unset and =1, alternating twice. At most 8 files under $OUT.
. bench/experiments/common.sh early
cp bench/results/h200-issue13/run18/J32/dispatch-judged.json $ST/given.json
cand=$(candidate linear_residual_rows) || exit 1
printf '\nCONFIGS = [p for p in CONFIGS if p["variant"] == "rows" and p["BLOCK_N"] == 1 and p["num_warps"] == 4]\n' >> $cand
timeout 60 python3 -m daemon.cli --read-only --state-dir $ST search linear_residual --source $cand \
  --device cuda --dtype bfloat16 --shape M=1,N=4096,K=4096 --budget all --dispatch-out $ST/found.json > $ST/search.log 2>&1
echo "search rc=$?"; tail -4 $ST/search.log
python3 bench/experiments/merge_entries.py $ST/given.json $ST/found.json $ST/new.json rows
for n in 1 2; do
  rows $ST/given.json 1x2048 b1-$n-given
  HWTUNE_PDL_EARLY=1 rows $ST/given.json 1x2048 b1-$n-given-early
  rows $ST/new.json 1x2048 b1-$n-rows
  HWTUNE_PDL_EARLY=1 rows $ST/new.json 1x2048 b1-$n-rows-early
done
merge_json "$OUT/rows.json" $ST/rows-*.json
