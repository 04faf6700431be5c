#!/bin/bash
# Run 22 of issue 13, one device call (< 600 s), read-only: what run 21 left owed, on the card lent.
#   1. VH: the hf-llama rows (hf compiled, patched) on the given table and on run 21's (H100: run
#      20's QR table): times 462489d, the fused step's attention lengths taken from the position
#   2. JS: run 21's table judged again at 1x2047 (the 2048-slot cache hf-llama's entries route)
#   3. R: the built-in rows, given / JS's table (run 21's where JS did not finish), alternating
#      twice, and the gap breakdown
#   4. VH again, given / JS's table, where JS changed the table
# GIVEN, NEW, LEDGER override the card's tables (run 23 on an H100: NEW = run 22's judged table).
# Later stages run only while the call has time left (DEADLINE_S, default 560 s). Files under $OUT
# (at most 6): run.log, js-dispatch.json, judges.json, rows.json, gaps.md, (harness-gpu.txt).
set -u -o pipefail
OUT=${OUT:?set OUT}; export COMMIT=${COMMIT:-unknown}
start=$SECONDS; left() { echo $(( ${DEADLINE_S:-560} - (SECONDS - start) )); }
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$name" in
  *H200*) given=bench/results/h200-issue13/run18/J32/dispatch-judged.json
          new=bench/results/h200-issue13/run21/dispatch-judged.json
          ledger=bench/results/h200-issue13/run21/ledger.sqlite ;;
  *H100*) given=bench/results/h100-issue13/run18-wide/wide-judged.json
          new=bench/results/h100-issue13/run20-qr/dispatch-judged.json
          ledger=bench/results/h100-issue13/run20-qr/ledger.sqlite ;;
  *) echo "no table for $name" > "$OUT/run.log"; exit 3 ;;
esac
given=${GIVEN:-$given}; new=${NEW:-$new}; ledger=${LEDGER:-$ledger}
rm -rf /tmp/hwtune-state /tmp/r22; mkdir -p /tmp/r22
stage() {  # stage NAME ARGS...: bench/issue13_gpu.sh ARGS with OUT=/tmp/r22/NAME, its log onto run.log
  local o=/tmp/r22/$1; shift; mkdir -p "$o"
  echo "== stage $* (card $name, $(left) s left) ==" >> "$OUT/run.log"
  OUT=$o bench/issue13_gpu.sh "$@" > "$o/stdout.txt" 2>&1
  echo "stage rc=$?" >> "$o/run.log"; cat "$o/run.log" "$o/stdout.txt" >> "$OUT/run.log" 2>/dev/null
}
stage vh VH "$given" "$new"
final=$new
if [ "$(left)" -gt 330 ]; then
  JUDGE_S=120 stage js JS "$new" 1x2047 "$ledger"
  if [ -f /tmp/r22/js/dispatch-judged.json ]; then
    cp /tmp/r22/js/dispatch-judged.json "$OUT/js-dispatch.json"
    cmp -s <(python3 -c "import json,sys; print(sorted(json.dumps(e, sort_keys=True) for e in json.load(open(sys.argv[1]))['entries']))" "$new") \
           <(python3 -c "import json,sys; print(sorted(json.dumps(e, sort_keys=True) for e in json.load(open(sys.argv[1]))['entries']))" /tmp/r22/js/dispatch-judged.json) \
      || final=/tmp/r22/js/dispatch-judged.json
  fi
fi
echo "final table: $final" >> "$OUT/run.log"
[ "$(left)" -gt 110 ] && stage r R "$given" "$final" && cp /tmp/r22/r/gaps.md "$OUT/gaps.md" 2>/dev/null
[ "$final" != "$new" ] && [ "$(left)" -gt 100 ] && stage vh2 VH "$given" "$final"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out, base = Path(sys.argv[1]), Path("/tmp/r22")
rows = {p.stem: json.loads(p.read_text()) for p in sorted(base.glob("r/r-*.json"))}
for vh in ("vh", "vh2"):
    f = base / vh / "rows.json"
    if f.exists():
        rows.update({f"{vh}-{k}": v for k, v in json.loads(f.read_text()).items()})
(out / "rows.json").write_text(json.dumps(rows))
judges = {n: json.loads((base / n / f"{n}-judge.json").read_text())
          for n in ("js",) if (base / n / f"{n}-judge.json").exists()}
(out / "judges.json").write_text(json.dumps(judges))
print(f"rows: {sorted(rows)}; judges: {sorted(judges)}")
PY
t=$(left)
if [ "$t" -gt 70 ]; then
  OUT=/tmp/r22 timeout $((t - 5)) python3 bench/harness_gpu.py --quick > "$OUT/harness-gpu.txt" 2>&1
  echo "harness_gpu rc=$? ($(left) s left)" >> "$OUT/run.log"
fi
ls -la "$OUT"
