#!/bin/bash
# One device call, read-only: `hwtune bench --model hf-llama --judge-in-step` on the card's own
# judged table and ledger (H200: run 21's; H100: run 20's), to check the step judge after its
# alternatives became verified by the harness (c24a624) and see what that costs. -> $OUT/judge.txt
set -u -o pipefail
OUT=${OUT:?set OUT}; export PYTHONUNBUFFERED=1 HWTUNE_READ_ONLY=1 PYTHONPATH=$PWD
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$name" in
  *H200*) src=bench/results/h200-issue13/run21 ;;
  *) src=bench/results/h100-issue13/run20-qr ;;
esac
rm -rf /tmp/j; mkdir -p /tmp/j/st; cp $src/ledger.sqlite /tmp/j/st/; cp $src/dispatch-judged.json /tmp/j/t.json
echo "card $name, table and ledger of $src" > "$OUT/judge.txt"
s=$SECONDS
timeout ${LIMIT_S:-420} python3 -m daemon.cli --read-only --state-dir /tmp/j/st bench --model hf-llama --layers 8 \
    --shapes 1x2048,32x2048 --variants hf-compiled,hf-hwtune --budget-s $(( ${LIMIT_S:-420} - 20 )) --steps 32 \
    --warmup 4 --check 4 --energy-window-s 0 --table /tmp/j/t.json --judge-in-step --out /tmp/j/o >> "$OUT/judge.txt" 2>&1
echo "rc=$? wall=$((SECONDS - s)) s" >> "$OUT/judge.txt"
grep -iE "card|judge|alternative|rejected|^hwtune patched|^hf compiled|rc=" "$OUT/judge.txt" | cut -c1-260 | tail -45
