#!/bin/bash
# Run 21 of issue 13, one device call (< 600 s), read-only: what run 20 left owed, on the card lent.
#   1. bench/issue13_gpu.sh QR on this card's judged table (run 18: J32 on an H200, wide-judged on an
#      H100): rmsnorm_qkv_rope and decode_attention searched into it, judged at batch 1
#   2. R: the built-in rows, given / QR's judged table, alternating twice, and the gap breakdown
#   3. JS: QR's judged table judged again at 1x2047 (the 2048-slot cache hf-llama's entries route)
#   4. VH: the hf-llama rows (hf compiled, patched) on the given table and on JS's
#   5. bench/harness_gpu.py --quick (the hostile demos on this card)
# Stages 3-5 run only while the call has time left (DEADLINE_S, default 560 s). Files under $OUT (8):
# run.log, dispatch-judged.json (QR's), js-dispatch.json, ledger.sqlite, judges.json (QR's and JS's
# judge results), rows.json (R's and VH's rows), gaps.md, harness-gpu.txt.
set -u -o pipefail
OUT=${OUT:?set OUT}; export COMMIT=${COMMIT:-unknown}
start=$SECONDS; left() { echo $(( ${DEADLINE_S:-560} - (SECONDS - start) )); }
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$name" in
  *H200*) given=bench/results/h200-issue13/run18/J32/dispatch-judged.json ;;
  *H100*) given=bench/results/h100-issue13/run18-wide/wide-judged.json ;;
  *) echo "no table for $name" > "$OUT/run.log"; exit 3 ;;
esac
rm -rf /tmp/hwtune-state /tmp/r21; mkdir -p /tmp/r21
stage() {  # stage NAME ARGS...: bench/issue13_gpu.sh ARGS with OUT=/tmp/r21/NAME, its log onto run.log
  local o=/tmp/r21/$1; shift; mkdir -p "$o"
  echo "== stage $* (card $name, $(left) s left) ==" >> "$OUT/run.log"
  OUT=$o bench/issue13_gpu.sh "$@" > "$o/stdout.txt" 2>&1
  echo "stage rc=$?" >> "$o/run.log"; cat "$o/run.log" "$o/stdout.txt" >> "$OUT/run.log" 2>/dev/null
}
QR_S=200 QR_BUDGET=170 JUDGE_S=150 stage qr QR "$given"
judged=/tmp/r21/qr/dispatch-judged.json
cp "$judged" "$OUT/dispatch-judged.json"; cp /tmp/r21/qr/ledger.sqlite "$OUT/ledger.sqlite"
stage r R "$given" "$judged"
cp /tmp/r21/r/gaps.md "$OUT/gaps.md" 2>/dev/null
final=$judged
if [ "$(left)" -gt 300 ]; then
  JUDGE_S=90 stage js JS "$judged" 1x2047 /tmp/r21/qr/ledger.sqlite
  [ -f /tmp/r21/js/dispatch-judged.json ] && final=/tmp/r21/js/dispatch-judged.json \
      && cp "$final" "$OUT/js-dispatch.json"
fi
[ "$(left)" -gt 200 ] && stage vh VH "$given" "$final"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out, base = Path(sys.argv[1]), Path("/tmp/r21")
rows = {p.stem: json.loads(p.read_text()) for p in sorted(base.glob("r/r-*.json"))}
vh = base / "vh" / "rows.json"
if vh.exists():
    rows.update({f"vh-{k}": v for k, v in json.loads(vh.read_text()).items()})
(out / "rows.json").write_text(json.dumps(rows))
judges = {n: json.loads((base / n / f"{n}-judge.json").read_text())
          for n in ("qr", "js") if (base / n / f"{n}-judge.json").exists()}
(out / "judges.json").write_text(json.dumps(judges))
print(f"rows: {sorted(rows)}; judges: {sorted(judges)}")
PY
t=$(left)
if [ "$t" -gt 60 ]; then
  OUT=/tmp/r21 timeout $((t - 5)) python3 bench/harness_gpu.py --quick > "$OUT/harness-gpu.txt" 2>&1
  echo "harness_gpu rc=$? ($(left) s left)" >> "$OUT/run.log"
fi
ls -la "$OUT"
