#!/bin/bash
# A rope_kv_attention candidate at batch 1, measured in the step (read-only; no GPU or host
# setting is changed):
#   [CANDIDATE=rope_kv_attention_lean] bench/experiments/combine_gpu.sh
# searches the candidate of bench/experiments/$CANDIDATE.patch (default rope_kv_attention_combine,
# the combine spread over the head dimension) through the harness (verified, timed against stock) at the built-in
# model's batch-1 attention shape into a fresh table, and puts its entry into a copy of this
# device's table (H200: run 18 J32's, H100: run 18's wide-judged one; both candidates' CONFIGS
# include those tables' batch-1 attention configs). Then it judges that copy's batch-1 step with 8
# configs an entry (so the candidate's configs meet in the step), and times the batch-1 rows on
# the given table and the judged copy, alternating three times (ROUNDS; JUDGE_S bounds the judge).
# At most 8 files under $OUT.
. bench/experiments/common.sh combine
case "$name" in
  *H200*) given=bench/results/h200-issue13/run18/J32/dispatch-judged.json ;;
  *) given=bench/results/h100-issue13/run18-wide/wide-judged.json ;;
esac
cp "$given" $ST/given.json
cand=$(candidate ${CANDIDATE:-rope_kv_attention_combine}) || exit 1
timeout 150 python3 -m daemon.cli --read-only --state-dir $ST search rope_kv_attention \
    --source $cand --device cuda --dtype bfloat16 \
    --shape B=1,Hq=32,Hkv=8,D=128,S=2112 --budget all --dispatch-out $ST/combine.json > $ST/search.log 2>&1
echo "search rc=$?"; tail -14 $ST/search.log
python3 bench/experiments/merge_entries.py $ST/given.json $ST/combine.json $ST/new.json "${CANDIDATE:-combine}"
judge $ST/new.json 1x2048 8 $ST/judge1.json
for n in $(seq 1 ${ROUNDS:-3}); do
  rows $ST/given.json 1x2048 b1-$n-given
  rows $ST/new.json 1x2048 b1-$n-new
done
merge_json "$OUT/rows.json" $ST/rows-*.json $ST/judge1.json
cp $ST/search.log "$OUT/search.log"; cp $ST/new.json "$OUT/combine-judged.json"
