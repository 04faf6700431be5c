#!/bin/bash
# Run 25 of issue 13, one device call (< 600 s), read-only, on an H200 (ANY_CARD=1: an H100 too, with
# the H100's tables; elsewhere it exits 3 having run nothing): what runs 22-24 measured on H100s and
# still owed the H200.
#   1. bench/issue13_run24.sh with ORDER="prev judged prev judged": `hwtune bench --model hf-llama
#      --judge-in-step` on run 21's table (its S 2048 entries never judged in a step), then the
#      hf-llama rows on run 18 J32's table (the path before the fused norm + q|k|v + RoPE) and on the
#      judged table, alternating
#   2. bench/issue13_gpu.sh R: the built-in rows (tuned-nopdl, tuned) on run 18 J32's table and the
#      judged table, alternating twice, then the gap breakdown on the judged table (its peers: eager
#      in a CUDA graph, the previous tuned step)
#   3. bench/harness_gpu.py --quick while time is left (DEADLINE_S, default 560 s)
# Files under $OUT (7): run.log, judge-results.json, dispatch-judged.json, rows.json (step 1),
# builtin-rows.json, gaps.md (step 2), harness-gpu.txt.
set -u -o pipefail
OUT=${OUT:?set OUT}; export COMMIT=${COMMIT:-unknown}
start=$SECONDS; left() { echo $(( ${DEADLINE_S:-560} - (SECONDS - start) )); }
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$name" in
  *H200*) prev=bench/results/h200-issue13/run18/J32/dispatch-judged.json ;;
  *H100*) [ -n "${ANY_CARD:-}" ] && prev=bench/results/h100-issue13/run18-wide/wide-judged.json ;;
esac
[ -n "${prev:-}" ] || { echo "card $name: run 25 is for an H200 (ANY_CARD=1: an H100 too); nothing run" | tee "$OUT/run.log"; exit 3; }
ORDER="prev judged prev judged" DEADLINE_S=$(( $(left) - 200 )) bench/issue13_run24.sh
judged=/tmp/r24/judged.json
[ -f "$judged" ] || { echo "no judged table; stopping" >> "$OUT/run.log"; exit 1; }
rm -rf /tmp/r25; mkdir -p /tmp/r25
echo "== R $prev $judged ($(left) s left) ==" >> "$OUT/run.log"
OUT=/tmp/r25 bench/issue13_gpu.sh R "$prev" "$judged" > /tmp/r25/stdout.txt 2>&1
echo "R rc=$?" >> "$OUT/run.log"; cat /tmp/r25/run.log /tmp/r25/stdout.txt >> "$OUT/run.log" 2>/dev/null
cp /tmp/r25/gaps.md "$OUT/gaps.md" 2>/dev/null
python3 -c "import json, sys, pathlib; pathlib.Path(sys.argv[1]).write_text(json.dumps({pathlib.Path(f).stem: json.loads(pathlib.Path(f).read_text()) for f in sys.argv[2:]}))" \
    "$OUT/builtin-rows.json" /tmp/r25/r-*.json
t=$(left)
if [ "$t" -gt 70 ]; then
  OUT=/tmp/r25 timeout $((t - 5)) python3 bench/harness_gpu.py --quick > "$OUT/harness-gpu.txt" 2>&1
  echo "harness_gpu rc=$? ($(left) s left)" >> "$OUT/run.log"
fi
echo "run 25 done ($(left) s left)" >> "$OUT/run.log"
ls -la "$OUT"
