#!/bin/bash
# Issue 13's measurements on the lent H200, read-only (no GPU or host setting is changed).
#   bench/issue13_gpu.sh search          search one dispatch table for both models' decode calls
#                                        (fused and unfused, batch 1 and 32): $OUT/dispatch.json
#   bench/issue13_gpu.sh bench TABLE     built-in rows (graphed, compile, tuned-unfused, tuned) and
#                                        hf-llama rows (eager, compiled, hwtune-unfused, hwtune)
#   bench/issue13_gpu.sh gaps TABLE      the built-in step's gap breakdown + GPU tests
#   bench/issue13_gpu.sh A               search (decode attention deeper first), then the hf-llama
#                                        rows on that table
#   bench/issue13_gpu.sh B TABLE         the built-in rows (no compile row), the gap breakdown, GPU tests
#   bench/issue13_gpu.sh C TABLE         TABLE without its decode_attention entries, decode attention
#                                        searched again (timed at full cache length), the built-in
#                                        rows, the gap breakdown, bench/attn_probe.py, an ncu report
#                                        of the batch-32 attention kernel, the GPU guard tests
#   bench/issue13_gpu.sh D TABLE         TABLE as it is, rope_kv_attention searched into it (timed at
#                                        full cache length), then the built-in rows, the hf-llama
#                                        rows and the gap breakdown on that one table
#   bench/issue13_gpu.sh E TABLE         TABLE as it is, the four projection templates searched into
#                                        it over all their CONFIGS (their entries are stale once their
#                                        source changed): $OUT/dispatch.json
#   bench/issue13_gpu.sh F TABLE         on TABLE: the built-in rows, the hf-llama rows and the gap
#                                        breakdown (E and F: one device call each, < 10 minutes)
#   bench/issue13_gpu.sh G TABLE         on TABLE: the gap breakdown alone (per layer position too)
#   bench/issue13_gpu.sh H TABLE         TABLE without the four projection templates' entries, those
#                                        searched again (kernels launched with PDL), the GPU tests of
#                                        PDL and the verifier guards, the built-in rows (with tuned-nopdl)
#   bench/issue13_gpu.sh I TABLE         on TABLE: the hf-llama rows, the built-in rows again and the
#                                        gap breakdown
#   bench/issue13_gpu.sh J TABLE         the GPU tests of PDL, early reads and the verifier guards,
#                                        TABLE less the three projection templates whose gemv now loads
#                                        its first step early, those searched again ($OUT/dispatch.json),
#                                        then bench/pdl_probe.py (batch 32, then batch 1 with attention
#                                        and the persistent step)
#   bench/issue13_gpu.sh K TABLE         the built-in rows (tuned-unfused, tuned-nopdl, tuned) on TABLE
#                                        with HWTUNE_PDL_EARLY / HWTUNE_PDL_TRIGGER 0/none, 1/none,
#                                        1/late, 0/none again (the spread); tuned-unfused in the early-0
#                                        rows runs templates the change left as they were: the same-run
#                                        yardstick for tuned / tuned-unfused against run 10's
#   bench/issue13_gpu.sh L TABLE         the hf-llama rows on TABLE with HWTUNE_PDL_EARLY=1 and a fresh
#                                        inductor cache, then bench/harness_gpu.py --quick
#   bench/issue13_gpu.sh M TABLE         TABLE less the three projection templates, those searched again
#                                        ($OUT/dispatch.json), the built-in tuned rows on it with early
#                                        reads / trigger 0/late, 1/late, 0/none, 1/late again, then the
#                                        gap breakdown with 1/late
#   bench/issue13_gpu.sh N TABLE         early reads off, trigger none / late / none / late: the built-in
#                                        rows (graphed, tuned-unfused, tuned-nopdl, tuned), then the
#                                        hf-llama rows (hf compiled, unfused, patched) with none and late
#   bench/issue13_gpu.sh O TABLE         trigger late: TABLE less rope_kv_attention, that searched again
#                                        deeper (EVALS, default 132 of its 396 configs a shape), the
#                                        built-in rows (tuned-nopdl, tuned) on the new table and on TABLE,
#                                        then the gap breakdown on the new table
#   bench/issue13_gpu.sh P TABLE         the defaults (no HWTUNE_PDL_* set): the GPU tests of PDL, early
#                                        reads and the verifier guards, bench/harness_gpu.py --quick,
#                                        the built-in rows (tuned-nopdl, tuned) on TABLE, then
#                                        bench/pdl_probe.py at batch 1 (pre+late split: late+apre, late+gpre)
#   bench/issue13_gpu.sh VH GIVEN NEW    the hf-llama rows (hf compiled, patched) on GIVEN, then NEW (rows.json)
#   bench/issue13_gpu.sh UF TABLE        the unfused templates searched into TABLE (batch 1 and 32, 8 configs a
#                                        shape: $OUT/dispatch.json), the built-in rows with tuned-unfused (the
#                                        previous tuned step) three times, the hf-llama rows once (rows.json)
#   bench/issue13_gpu.sh J32 TABLE       TABLE less the fused projections' batch-32 entries, those searched
#                                        over all their configs, judged at batch 32 with 8 configs an entry
#                                        ($OUT/dispatch-judged.json), the built-in rows on TABLE and the judged
#                                        table, alternating (rows.json). UF and J32: run 16's hand-typed calls
#   bench/issue13_gpu.sh guards          the GPU tests of PDL, early reads, the verifier guards,
#                                        then bench/harness_gpu.py --quick (any card)
#   bench/issue13_gpu.sh W TABLE         ncu of the tuned step's first 12 kernels of ours on TABLE
#                                        (bench/ncu_step.py; NCU_S s a batch), batch 1 and 32: $OUT/ncu-b1.txt, ncu-b32.txt
#   bench/issue13_gpu.sh X               any H100 or H200: the four fused templates searched at batch 1
#                                        and 32 (EVALS a shape, BUDGET s), then W on that table
#   bench/issue13_gpu.sh Y [TABLE]       after X, same machine: on X's table (or TABLE) the built-in rows
#                                        (graphed, tuned-nopdl, tuned), the judge on a copy, the rows on
#                                        judged, judged, searched, the hf-llama rows on judged twice (all in
#                                        rows.json), then the gap breakdown on judged (run 15, by hand)
#   bench/issue13_gpu.sh Q TABLE         the step judge: TABLE less the three projection templates and
#                                        rope_kv_attention, those searched again (their configs in a fresh
#                                        ledger: $OUT/ledger.sqlite; $OUT/dispatch.json), then `hwtune bench
#                                        --judge-in-step` (tuned rows) on a copy of it, judged and written back
#                                        ($OUT/dispatch-judged.json; the decisions and the step as given / as
#                                        judged in q-judge.json). TABLE must be this device's (run13/M's is an
#                                        H200's: elsewhere run "search" first and give its table)
#   bench/issue13_gpu.sh QR TABLE        norm + q|k|v + RoPE + the cache write in one kernel: TABLE less
#                                        decode_attention, rmsnorm_qkv_rope (all 6 configs) and
#                                        decode_attention (QR_EVALS, default 24, configs a shape) searched
#                                        into it at batch 1 and 32 (a fresh ledger: $OUT/ledger.sqlite;
#                                        $OUT/dispatch.json), then the judge (JUDGE_TOP, default 8) on a copy
#                                        at batch 1 ($OUT/dispatch-judged.json, qr-judge.json): it keeps the
#                                        new path only where the step is faster than the table's own
#                                        (rope_kv_attention). Then JS JUDGED 1x2047 LEDGER, R TABLE JUDGED (the
#                                        rows, same machine) and VH TABLE JUDGED (the hf-llama rows)
#   bench/issue13_gpu.sh JS TABLE SHAPES [LEDGER]   the judge (JUDGE_TOP, default 8; alternatives from
#                                        LEDGER, else stock only) on a copy of TABLE at SHAPES
#                                        ($OUT/dispatch-judged.json, js-judge.json). SHAPES 1x2047 judges
#                                        the built-in step on a 2048-slot cache: the attention-side entries
#                                        hf-llama's StaticCache(2048) routes, which 1x2048 (2112 slots)
#                                        never judges
#   bench/issue13_gpu.sh R SEARCHED JUDGED   the built-in rows (tuned-nopdl, tuned) on SEARCHED, JUDGED,
#                                        SEARCHED, JUDGED (the same-run comparison), then the gap
#                                        breakdown on JUDGED
#   bench/issue13_gpu.sh S SEARCHED JUDGED   the hf-llama rows (hf compiled, unfused, patched) on SEARCHED,
#                                        then on JUDGED: the judgement in the user's model
#   bench/issue13_gpu.sh T SEARCHED LEDGER   the judge on a copy of SEARCHED with LEDGER as the state
#                                        directory's ledger ($OUT/dispatch-judged.json, t-judge.json), then
#                                        the built-in rows (tuned-nopdl, tuned) on SEARCHED, JUDGED, SEARCHED,
#                                        JUDGED, the hf-llama rows (hf compiled, patched) on both (all rows in
#                                        rows.json), then the gap breakdown on JUDGED
#   bench/issue13_gpu.sh U JUDGED LEDGER     JUDGED less rope_kv_attention, that searched again into LEDGER's
#                                        copy (ATTN_EVALS, default 40, stopped at ATTN_BUDGET s), then the judge
#                                        on it ($OUT/dispatch-judged.json, u-judge.json), then the built-in rows
#                                        (tuned-nopdl, tuned) on JUDGED and on the new table, twice (rows.json)
#   bench/issue13_gpu.sh V JUDGED LEDGER     the judge again on a copy of JUDGED with LEDGER, JUDGE_TOP
#                                        (default 8) configs an entry ($OUT/dispatch-judged.json, v-judge.json),
#                                        the built-in rows on JUDGED and the new table, twice, then the hf-llama
#                                        rows (hf compiled, patched) on both (rows.json)
#                                        (V_HF=0: without the hf-llama rows; then VH JUDGED NEW gives them)
# Writes at most 8 files under $OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1 HWTUNE_READ_ONLY=1
OUT=${OUT:-out/issue13}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
ST=/tmp/hwtune-state
what=${1:-search}; table=${2:-}
{ date -u; echo "commit ${COMMIT:-unknown} mode $what"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,persistence_mode --format=csv
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > "$OUT/env.txt" 2>&1
hf_rows() {
  timeout ${HF_S:-320} python3 -m daemon.cli --read-only --state-dir $ST bench --model hf-llama --layers 8 \
      --shapes 1x2048,32x2048 --variants hf-eager,hf-compiled,hf-hwtune-unfused,hf-hwtune --budget-s 300 \
      --steps 32 --warmup 4 --check 4 --energy-window-s 2 --table "$1" --out "$OUT/hf" > "$OUT/hf.log" 2>&1
  echo "bench rc=$?" >> "$OUT/hf.log"
  cp "$OUT/hf/results.json" "$OUT/hf-results.json" 2>/dev/null; rm -rf "$OUT/hf"
}
search_projections() {  # search_projections TABLE JSON: TABLE less the three fused projection
  # templates, those searched again at batch 1 and 32 ($OUT/dispatch.json; the search's JSON to JSON)
  seed_table "$1" linear_residual,rmsnorm_linear,rmsnorm_gate_up_swiglu
  timeout ${SEARCH_S:-200} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels linear_residual,rmsnorm_linear,rmsnorm_gate_up_swiglu --budget-s ${BUDGET:-170} \
      --evals ${EVALS:-20} --json "$2"
  echo "projection search rc=$?"
  cp $ST/dispatch/*.json "$OUT/dispatch.json"
}
search_attention() {  # search_attention TABLE EVALS BUDGET_S TIMEOUT_S JSON: $ST's table = TABLE less
  # rope_kv_attention, that searched again at batch 1 and 32 (-> $OUT/dispatch.json; the search's JSON to JSON)
  seed_table "$1" rope_kv_attention
  timeout $4 python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels rope_kv_attention --budget-s $3 --evals $2 --json "$5"
  echo "attention search rc=$?"
  cp $ST/dispatch/*.json "$OUT/dispatch.json"
}
step_rows() {  # step_rows TABLE VARIANTS FILE [TIMEOUT_S]: the built-in rows on TABLE (no energy
  # window; killed after TIMEOUT_S, default 100, the bench's budget 10 s less) -> $OUT/FILE; the bench's rc
  local s=${4:-100} rc
  timeout $s python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes 1x2048,32x2048 --variants "$2" --budget-s $((s - 10)) --energy-window-s 0 \
      --table "$1" --out "$OUT/b"
  rc=$?
  cp "$OUT/b/results.json" "$OUT/$3"; rm -rf "$OUT/b"
  return $rc
}
gap_rows() {  # gap_rows TABLE [TIMEOUT_S]: bench/gaps_gpu.py on TABLE (gaps.md, gaps.json)
  timeout ${2:-150} python3 bench/gaps_gpu.py --table "$1" --shapes 1x2048,32x2048 --out "$OUT"
  echo "gaps rc=$?"; rm -f "$OUT"/events-*.json
}
builtin_rows() {  # builtin_rows TABLE [SUFFIX]: the built-in rows on TABLE (builtin-results$SUFFIX.json)
  timeout 200 python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes 1x2048,32x2048 --variants graphed,tuned-unfused,tuned-nopdl,tuned --budget-s 180 \
      --energy-window-s 2 --table "$1" --out "$OUT/builtin"
  echo "bench rc=$?"
  cp "$OUT/builtin/results.json" "$OUT/builtin-results${2:-}.json"; rm -rf "$OUT/builtin"
}
model_rows() {  # model_rows TABLE: built-in rows, hf-llama rows, gap breakdown, all on TABLE
  builtin_rows "$1"
  timeout ${HF_S:-240} python3 -m daemon.cli --read-only --state-dir $ST bench --model hf-llama --layers 8 \
      --shapes 1x2048,32x2048 --variants hf-eager,hf-compiled,hf-hwtune-unfused,hf-hwtune --budget-s 220 \
      --steps 32 --warmup 4 --check 4 --energy-window-s 2 --table "$1" --out "$OUT/hf"
  echo "hf bench rc=$?"
  cp "$OUT/hf/results.json" "$OUT/hf-results.json"; rm -rf "$OUT/hf"
  gap_rows "$1" 220
}
judge_step() {  # judge_step TABLE TIMEOUT_S JSON [SHAPES]: `hwtune bench --judge-in-step` (tuned rows;
  # SHAPES default 1x2048,32x2048) on TABLE, judged and written back in place; the bench's results to JSON
  timeout $2 python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes ${4:-1x2048,32x2048} --variants tuned --judge-in-step ${JUDGE_TOP:+--judge-top $JUDGE_TOP} \
      --budget-s $(($2 - 10)) --energy-window-s 0 --table "$1" --out "$OUT/j"
  echo "judge rc=$?"
  cp "$OUT/j/results.json" "$3"; rm -rf "$OUT/j" "$1.lock"
}
alternate_rows() {  # alternate_rows A B NAME_A NAME_B PREFIX DIR: the built-in rows (tuned-nopdl, tuned)
  # on A, B, A, B (the same-run comparison) -> DIR/PREFIX-n-NAME.json
  local n=0 t which
  for t in "$1" "$2" "$1" "$2"; do
    n=$((n + 1)); which=$3; [ "$t" = "$2" ] && which=$4
    step_rows "$t" tuned-nopdl,tuned "$5-$n-$which.json" 60
    echo "table $which rc=$?"; mv "$OUT/$5-$n-$which.json" "$6"/ 2>/dev/null
  done
}
hf_row() {  # hf_row TABLE FILE TIMEOUT_S NAME [VARIANTS]: the hf-llama rows (default hf compiled,
  # patched) on TABLE -> FILE (killed after TIMEOUT_S, the bench's budget 10 s less)
  timeout $3 python3 -m daemon.cli --read-only --state-dir $ST bench --model hf-llama --layers 8 \
      --shapes 1x2048,32x2048 --variants ${5:-hf-compiled,hf-hwtune} --budget-s $(($3 - 10)) --steps 32 \
      --warmup 4 --check 4 --energy-window-s 0 --table "$1" --out "$OUT/hf"
  echo "hf table $4 rc=$?"
  cp "$OUT/hf/results.json" "$2"; rm -rf "$OUT/hf"
}
hf_pair() {  # hf_pair A B NAME_A NAME_B DIR: the hf-llama rows (hf compiled, patched) on A, then on B
  # -> DIR/s-NAME.json
  hf_row "$1" "$5/s-$3.json" 130 $3
  hf_row "$2" "$5/s-$4.json" 130 $4
}
judge_compare() {  # judge_compare TABLE JUDGE_S JSON NAME_A NAME_B PREFIX: a copy of TABLE judged
  # ($OUT/dispatch-judged.json; the judge's results to JSON), then the built-in rows on both,
  # alternating, and the hf-llama rows on both ($OUT/rows.json)
  local new=$OUT/dispatch-judged.json rows
  cp "$1" "$new"
  judge_step "$new" $2 "$3"
  rows=$(mktemp -d)   # a warm machine keeps /tmp: never an earlier stage's rows
  alternate_rows "$1" "$new" $4 $5 $6 "$rows"
  [ "${V_HF:-1}" = 0 ] || hf_pair "$1" "$new" $4 $5 "$rows"   # V_HF=0: no hf-llama rows (stage VH)
  merge_rows "$rows"
}
seed_ledger() {  # seed_ledger LEDGER: $ST's ledger = a copy of LEDGER
  mkdir -p $ST; cp "$1" $ST/ledger.sqlite
}
merge_rows() {  # merge_rows DIR: every DIR/*.json into $OUT/rows.json, keyed by file name (8 files)
  python3 -c "import json, sys, pathlib; pathlib.Path(sys.argv[1]).write_text(json.dumps({pathlib.Path(f).stem: json.loads(pathlib.Path(f).read_text()) for f in sys.argv[2:]}))" \
      "$OUT/rows.json" "$1"/*.json
}
backup_ledger() {  # a search killed by its timeout leaves its rows in the -wal: a backup copies them too
  python3 -c "import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))" \
      $ST/ledger.sqlite "$OUT/ledger.sqlite"
}
seed_table() {  # seed_table TABLE [KERNEL,... [M]]: $ST's table for this device = TABLE, less those
  # kernels' entries (with M: only their entries at that batch, shape M)
  python3 - "$1" "$ST" "${2:-}" "${3:-}" <<'PY'
import json, sys
from pathlib import Path
from kernelsearch.fingerprint import collect, fingerprint_id
seed, state, drop, at_m = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
doc = json.loads(Path(seed).read_text())
fp = fingerprint_id(collect("cuda"))
if doc.get("fingerprint_id") != fp:
    print(f"seed table is for {doc.get('fingerprint_id')}, this device is {fp}: not seeded")
    sys.exit(0)
doc["entries"] = [e for e in doc["entries"] if e["kernel"] not in drop.split(",")
                  or (at_m and e["shape"].get("M") != int(at_m))]
(state / "dispatch").mkdir(parents=True, exist_ok=True)
(state / "dispatch" / f"{fp}.json").write_text(json.dumps(doc))
print(f"seeded {len(doc['entries'])} entries" + (f" ({drop} left out" + (f" at M={at_m})" if at_m else ")")
                                                  if drop else "") + f" for {fp}")
PY
}
device_table() {  # device_table TABLE: stop here unless TABLE was made on this device (its fingerprint):
  # elsewhere no entry routes and every "tuned" row would time stock (a lent call may get an H100)
  python3 - "$1" <<'PY' || exit 3
import json, sys
from kernelsearch.fingerprint import collect, fingerprint_id
path = sys.argv[1]
want, here = json.load(open(path)).get("fingerprint_id"), fingerprint_id(collect("cuda"))
if want != here:
    print(f"stopped: {path} is for {want}, this device is {here}: none of its entries would route here")
    sys.exit(1)
PY
}
ncu_layers() {  # ncu_layers TABLE: the tuned step on TABLE under ncu (bench/ncu_step.py), batch 1 and
  # 32: the first 12 of our kernels of its last step, each alone (plain launches, caches flushed
  # between replays; NCU_S seconds a batch) -> $OUT/ncu-b1.txt, ncu-b32.txt
  local b
  for b in 1 32; do
    timeout ${NCU_S:-200} ncu --clock-control none --profile-from-start off \
        -k "regex:_gemv_kernel|_splitk_kernel|_rope_attn_kernel|_combine_kernel|_rmsnorm_kernel" \
        --launch-count 12 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 bench/ncu_step.py --table "$1" --batch $b > "$OUT/ncu-b$b.txt" 2>&1
    echo "ncu b$b rc=$?"
  done
}
case "$what" in
A)
  # decode attention first, deeper (its grid is twice the size with REDUCE), then every other call
  timeout ${ATTN_S:-120} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels decode_attention --budget-s ${ATTN_BUDGET:-100} --evals ${ATTN_EVALS:-40} \
      --json "$OUT/search-attention.json" > "$OUT/search.log" 2>&1
  echo "attention search rc=$?" >> "$OUT/search.log"
  timeout ${SEARCH_S:-300} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --budget-s ${BUDGET:-260} --evals ${EVALS:-14} --json "$OUT/search.json" >> "$OUT/search.log" 2>&1
  echo "search rc=$?" >> "$OUT/search.log"
  cp $ST/dispatch/*.json "$OUT/dispatch.json" 2>/dev/null
  hf_rows "$OUT/dispatch.json" ;;
B)
  timeout 200 python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes 1x2048,32x2048 --variants graphed,tuned-unfused,tuned --budget-s 180 \
      --energy-window-s 2 --table "$table" --out "$OUT/builtin" > "$OUT/builtin.log" 2>&1
  echo "bench rc=$?" >> "$OUT/builtin.log"
  cp "$OUT/builtin/results.json" "$OUT/builtin-results.json" 2>/dev/null; rm -rf "$OUT/builtin"
  timeout 200 python3 bench/gaps_gpu.py --table "$table" --shapes 1x2048,32x2048 --out "$OUT" > "$OUT/gaps.log" 2>&1
  echo "gaps rc=$?" >> "$OUT/gaps.log"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_verifier_guards.py tests/test_gaps.py > "$OUT/gputests.txt" 2>&1
  timeout 100 python3 -m pytest -q -p no:cacheprovider -k "ptx or PTX" tests/test_kernel_linear_residual.py \
      tests/test_kernel_rmsnorm_linear.py tests/test_kernel_rmsnorm_gate_up_swiglu.py tests/test_linear_gemv.py >> "$OUT/gputests.txt" 2>&1 ;;
C)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  seed_table "$table" decode_attention
  timeout ${ATTN_S:-150} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels decode_attention --budget-s ${ATTN_BUDGET:-120} --evals ${ATTN_EVALS:-40}
  echo "attention search rc=$?"
  cp $ST/dispatch/*.json "$OUT/dispatch.json"   # the other kernels' shapes: as TABLE has them
  timeout 200 python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes 1x2048,32x2048 --variants graphed,tuned-unfused,tuned --budget-s 180 \
      --energy-window-s 2 --table "$OUT/dispatch.json" --out "$OUT/builtin"
  echo "bench rc=$?"
  cp "$OUT/builtin/results.json" "$OUT/builtin-results.json"; rm -rf "$OUT/builtin"
  gap_rows "$OUT/dispatch.json" 200
  timeout 120 python3 bench/attn_probe.py --json "$OUT/attn-probe.json"
  echo "probe rc=$?"
  cfg=$(python3 -c "import json,sys; e=[e for e in json.load(open('$OUT/dispatch.json'))['entries'] if e['kernel']=='decode_attention' and e['shape']['B']==32 and e['shape']['S']==2112]; print(json.dumps(e[0]['params']) if e else '{}')")
  echo "ncu config B=32: $cfg"
  timeout 120 ncu --clock-control none -k regex:_split_kernel -c 1 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
      --section SchedulerStats python3 bench/attn_probe.py --one "32:$cfg" > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_verifier_guards.py
  echo "gpu tests rc=$?" ;;
D)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  seed_table "$table"
  timeout ${ATTN_S:-200} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels rope_kv_attention --budget-s ${ATTN_BUDGET:-180} --evals ${ATTN_EVALS:-40}
  echo "rope_kv_attention search rc=$?"
  cp $ST/dispatch/*.json "$OUT/dispatch.json"
  model_rows "$OUT/dispatch.json" ;;
E)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  seed_table "$table"
  timeout ${SEARCH_S:-540} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels linear,linear_residual,rmsnorm_linear,rmsnorm_gate_up_swiglu --budget-s ${BUDGET:-500} \
      --evals ${EVALS:-20} --json "$OUT/search.json"
  echo "projection search rc=$?"
  cp $ST/dispatch/*.json "$OUT/dispatch.json" ;;
F)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  model_rows "$table" ;;
G)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  gap_rows "$table" 200 ;;
H)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  seed_table "$table" linear,linear_residual,rmsnorm_linear,rmsnorm_gate_up_swiglu
  timeout ${SEARCH_S:-300} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels linear,linear_residual,rmsnorm_linear,rmsnorm_gate_up_swiglu --budget-s ${BUDGET:-270} \
      --evals ${EVALS:-20} --json "$OUT/search.json"
  echo "projection search rc=$?"
  cp $ST/dispatch/*.json "$OUT/dispatch.json"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py tests/test_verifier_guards.py
  echo "gpu tests rc=$?"
  builtin_rows "$OUT/dispatch.json" -1 ;;
I)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  model_rows "$table" ;;
J)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py tests/test_pdl_early.py \
      tests/test_verifier_guards.py
  echo "gpu tests rc=$?"
  search_projections "$table" "$OUT/search.json"
  # last: the table above is what stage K needs; the probe writes its JSON after each batch
  timeout ${PROBE_S:-230} python3 bench/pdl_probe.py --layers 8 --json "$OUT/pdl-probe.json"
  echo "pdl probe rc=$?" ;;
K)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  n=0
  for cfg in 0:none 1:none 1:late 0:none; do
    n=$((n + 1)); e=${cfg%%:*}; t=${cfg##*:}
    HWTUNE_PDL_EARLY=$e HWTUNE_PDL_TRIGGER=$t step_rows "$table" tuned-unfused,tuned-nopdl,tuned \
        "b-$n-early$e-$t.json" 130
    echo "early $e trigger $t rc=$?"
  done ;;
L)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)   # a cold compile: what a new user's first run does
  export HWTUNE_PDL_EARLY=1 HF_S=${HF_S:-330}
  hf_rows "$table"; cat "$OUT/hf.log"; rm -f "$OUT/hf.log"
  OUT=$OUT timeout ${HARNESS_S:-200} python3 bench/harness_gpu.py --quick > "$OUT/harness-gpu.txt" 2>&1
  echo "harness_gpu rc=$?" ;;
M)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  # the three projection templates searched again (their source changed), then the tuned rows
  search_projections "$table" /tmp/m-search.json   # 8 files: run.log has its summary
  n=0
  for cfg in 0:late 1:late 0:none 1:late; do   # K lacked 0/late: is the gain the trigger's or the reads'?
    n=$((n + 1)); e=${cfg%%:*}; t=${cfg##*:}
    HWTUNE_PDL_EARLY=$e HWTUNE_PDL_TRIGGER=$t step_rows "$OUT/dispatch.json" tuned "m-$n-early$e-$t.json"
    echo "early $e trigger $t rc=$?"
  done
  ( export HWTUNE_PDL_EARLY=1 HWTUNE_PDL_TRIGGER=late; gap_rows "$OUT/dispatch.json" 120 ) ;;
N)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  n=0
  for t in none late none late; do   # is "late" (without early reads) the better default?
    n=$((n + 1))
    HWTUNE_PDL_EARLY=0 HWTUNE_PDL_TRIGGER=$t step_rows "$table" graphed,tuned-unfused,tuned-nopdl,tuned \
        "n-$n-$t.json"
    echo "trigger $t rc=$?"
  done
  for t in none late; do
    HWTUNE_PDL_EARLY=0 HWTUNE_PDL_TRIGGER=$t timeout 150 python3 -m daemon.cli --read-only --state-dir $ST \
        bench --model hf-llama --layers 8 --shapes 1x2048,32x2048 \
        --variants hf-compiled,hf-hwtune-unfused,hf-hwtune --budget-s 140 --steps 32 --warmup 4 \
        --check 4 --energy-window-s 0 --table "$table" --out "$OUT/hf"
    echo "hf trigger $t rc=$?"
    cp "$OUT/hf/results.json" "$OUT/hf-$t.json"; rm -rf "$OUT/hf"
  done ;;
O)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  export HWTUNE_PDL_EARLY=0 HWTUNE_PDL_TRIGGER=late
  search_attention "$table" ${EVALS:-132} ${BUDGET:-250} ${SEARCH_S:-280} /tmp/o-search.json
  for which in new given; do
    t=$OUT/dispatch.json; [ $which = given ] && t=$table
    step_rows "$t" tuned-nopdl,tuned "o-$which.json"
    echo "table $which rc=$?"
  done
  gap_rows "$OUT/dispatch.json" 130 ;;
P)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  unset HWTUNE_PDL HWTUNE_PDL_EARLY HWTUNE_PDL_TRIGGER
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py tests/test_pdl_early.py \
      tests/test_verifier_guards.py
  echo "gpu tests rc=$?"
  OUT=$OUT timeout ${HARNESS_S:-200} python3 bench/harness_gpu.py --quick > "$OUT/harness-gpu.txt" 2>&1
  echo "harness_gpu rc=$?"
  step_rows "$table" tuned-nopdl,tuned p-builtin.json
  echo "bench rc=$?"
  timeout ${PROBE_S:-150} python3 bench/pdl_probe.py --layers 8 --batches 1 --persistent "" \
      --l2-prefetch "" --json "$OUT/pdl-probe.json"
  echo "pdl probe rc=$?" ;;
Q)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  SEARCH_S=${SEARCH_S:-170} BUDGET=${BUDGET:-140} search_projections "$table" /tmp/q-search.json  # seeds $ST
  search_attention "$OUT/dispatch.json" ${ATTN_EVALS:-24} ${ATTN_BUDGET:-60} ${ATTN_S:-150} /tmp/q-attn.json
  cp "$OUT/dispatch.json" "$OUT/dispatch-judged.json"
  judge_step "$OUT/dispatch-judged.json" ${JUDGE_S:-260} "$OUT/q-judge.json"
  backup_ledger ;;
QR)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  seed_table "$table" decode_attention   # its entries searched again, beside the new kernel's
  timeout ${QR_S:-260} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels rmsnorm_qkv_rope,decode_attention --budget-s ${QR_BUDGET:-230} --evals ${QR_EVALS:-24} \
      --json /tmp/qr-search.json
  echo "qkv_rope search rc=$?"
  cp $ST/dispatch/*.json "$OUT/dispatch.json"
  cp "$OUT/dispatch.json" "$OUT/dispatch-judged.json"
  JUDGE_TOP=${JUDGE_TOP:-8} judge_step "$OUT/dispatch-judged.json" ${JUDGE_S:-250} "$OUT/qr-judge.json" 1x2048
  backup_ledger ;;
JS)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  [ -n "${4:-}" ] && seed_ledger "$4"   # the ledger QR wrote: the judge's alternatives besides stock
  cp "$table" "$OUT/dispatch-judged.json"
  JUDGE_TOP=${JUDGE_TOP:-8} judge_step "$OUT/dispatch-judged.json" ${JUDGE_S:-300} "$OUT/js-judge.json" \
      "${3:?usage: issue13_gpu.sh JS TABLE SHAPES [LEDGER]}" ;;
R)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  judged=${3:?usage: issue13_gpu.sh R SEARCHED JUDGED}
  n=0
  for t in "$table" "$judged" "$table" "$judged"; do
    n=$((n + 1)); which=searched; [ "$t" = "$judged" ] && which=judged
    step_rows "$t" tuned-nopdl,tuned "r-$n-$which.json"
    echo "table $which rc=$?"
  done
  gap_rows "$judged" 130 ;;
S)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  judged=${3:?usage: issue13_gpu.sh S SEARCHED JUDGED}
  for which in searched judged; do
    t=$table; [ $which = judged ] && t=$judged
    timeout 200 python3 -m daemon.cli --read-only --state-dir $ST bench --model hf-llama --layers 8 \
        --shapes 1x2048,32x2048 --variants hf-compiled,hf-hwtune-unfused,hf-hwtune --budget-s 190 --steps 32 \
        --warmup 4 --check 4 --energy-window-s 0 --table "$t" --out "$OUT/hf"
    echo "hf table $which rc=$?"
    cp "$OUT/hf/results.json" "$OUT/s-$which.json"; rm -rf "$OUT/hf"
  done ;;
T)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  seed_ledger "${3:?usage: issue13_gpu.sh T SEARCHED LEDGER}"
  judge_compare "$table" ${JUDGE_S:-200} "$OUT/t-judge.json" searched judged r
  gap_rows "$OUT/dispatch-judged.json" 120 ;;
U)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  seed_ledger "${3:?usage: issue13_gpu.sh U JUDGED LEDGER}"
  search_attention "$table" ${ATTN_EVALS:-40} ${ATTN_BUDGET:-170} ${ATTN_S:-230} /tmp/u-attn.json
  new=$OUT/dispatch-judged.json; mv "$OUT/dispatch.json" "$new"
  judge_step "$new" ${JUDGE_S:-120} "$OUT/u-judge.json"
  rows=$(mktemp -d)   # a warm machine keeps /tmp: never an earlier stage's rows
  alternate_rows "$table" "$new" given new u "$rows"
  merge_rows "$rows"
  backup_ledger ;;
V)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  seed_ledger "${3:?usage: issue13_gpu.sh V JUDGED LEDGER}"
  JUDGE_TOP=${JUDGE_TOP:-8} judge_compare "$table" ${JUDGE_S:-200} "$OUT/v-judge.json" given new v ;;
VH)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  rows=$(mktemp -d)
  hf_pair "$table" "${3:?usage: issue13_gpu.sh VH GIVEN NEW}" given new "$rows"
  merge_rows "$rows" ;;
UF)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  # run 16's A and B (by hand there): the unfused templates searched into TABLE, the built-in rows
  # (graphed once, then tuned-unfused, tuned-nopdl, tuned) three times, the hf-llama rows once;
  # every timeout together within one 600 s device call (run 16: 121 s of search, ~25 s a row)
  seed_table "$table"
  timeout 250 python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels linear,add_rmsnorm,rmsnorm,rope_kv_write,decode_attention --budget-s 220 --evals 8 \
      --json "$OUT/unfused-search.json"
  echo "unfused search rc=$?"
  cp $ST/dispatch/*.json "$OUT/dispatch.json"
  rows=$(mktemp -d)
  step_rows "$OUT/dispatch.json" graphed,tuned-unfused,tuned-nopdl,tuned uf-1.json 80; mv "$OUT/uf-1.json" "$rows"/
  step_rows "$OUT/dispatch.json" tuned-unfused,tuned-nopdl,tuned uf-2.json 60; mv "$OUT/uf-2.json" "$rows"/
  step_rows "$OUT/dispatch.json" tuned-unfused,tuned-nopdl,tuned uf-3.json 60; mv "$OUT/uf-3.json" "$rows"/
  hf_row "$OUT/dispatch.json" "$rows/hf.json" 110 uf hf-compiled,hf-hwtune-unfused,hf-hwtune
  merge_rows "$rows" ;;
J32)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  # run 16's C and D (by hand there): TABLE less the batch-32 entries of the three fused projection
  # templates, those searched again over all their configs, judged (top 8) at batch 32 into
  # $OUT/dispatch-judged.json, then the built-in rows on TABLE and the judged table, alternating;
  # every timeout together within one 600 s device call (run 16: 42 s search, ~30 s judge)
  seed_table "$table" linear_residual,rmsnorm_linear,rmsnorm_gate_up_swiglu 32
  timeout 150 python3 bench/search_decode.py --state-dir $ST --shapes 32x2048 \
      --kernels linear_residual,rmsnorm_linear,rmsnorm_gate_up_swiglu --budget-s 130 --evals 40
  echo "batch-32 search rc=$?"
  new=$OUT/dispatch-judged.json; cp $ST/dispatch/*.json "$new"
  JUDGE_TOP=8 judge_step "$new" 150 "$OUT/j32-judge.json" 32x2048
  rows=$(mktemp -d)
  alternate_rows "$table" "$new" given judged j "$rows"
  merge_rows "$rows" ;;
guards)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pdl.py tests/test_pdl_early.py \
      tests/test_verifier_guards.py
  echo "gpu tests rc=$?"
  OUT=$OUT timeout ${HARNESS_S:-200} python3 bench/harness_gpu.py --quick > "$OUT/harness-gpu.txt" 2>&1
  echo "harness_gpu rc=$?" ;;
W)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  device_table "$table"
  ncu_layers "$table" ;;
X)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  timeout ${SEARCH_S:-260} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --kernels rmsnorm_linear,rope_kv_attention,linear_residual,rmsnorm_gate_up_swiglu \
      --budget-s ${BUDGET:-240} --evals ${EVALS:-12}
  echo "search rc=$?"
  cp $ST/dispatch/*.json "$OUT/dispatch.json"
  ncu_layers "$OUT/dispatch.json" ;;
Y)
  exec >> "$OUT/run.log" 2>&1
  cat "$OUT/env.txt"; rm -f "$OUT/env.txt"
  # after X on the same (warm) machine: its table, or TABLE
  [ -n "$table" ] || table=$(ls $ST/dispatch/*.json | head -1)
  device_table "$table"
  s=$OUT/searched.json j=$OUT/judged.json rows=$(mktemp -d)
  cp "$table" "$s"; cp "$table" "$j"
  step_rows "$s" graphed,tuned-nopdl,tuned r1-searched.json 80; mv "$OUT/r1-searched.json" "$rows"/
  judge_step "$j" ${JUDGE_S:-150} "$rows/judge.json"
  step_rows "$j" tuned-nopdl,tuned r2-judged.json 50; mv "$OUT/r2-judged.json" "$rows"/
  step_rows "$j" tuned-nopdl,tuned r3-judged.json 50; mv "$OUT/r3-judged.json" "$rows"/
  step_rows "$s" tuned-nopdl,tuned r4-searched.json 50; mv "$OUT/r4-searched.json" "$rows"/
  hf_row "$j" "$rows/hf-1.json" 100 judged-1
  hf_row "$j" "$rows/hf-2.json" 100 judged-2
  merge_rows "$rows"
  gap_rows "$j" 100 ;;
search)
  timeout ${SEARCH_S:-540} python3 bench/search_decode.py --state-dir $ST --shapes 1x2048,32x2048 \
      --budget-s ${BUDGET:-480} --evals ${EVALS:-8} --json "$OUT/search.json" > "$OUT/search.log" 2>&1
  echo "search rc=$?" >> "$OUT/search.log"
  cp $ST/dispatch/*.json "$OUT/dispatch.json" 2>/dev/null ;;
bench)
  timeout 260 python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes 1x2048,32x2048 --variants graphed,compile,tuned-unfused,tuned --budget-s 240 \
      --energy-window-s 2 --table "$table" --out "$OUT/builtin" > "$OUT/builtin.log" 2>&1
  echo "bench rc=$?" >> "$OUT/builtin.log"
  timeout ${HF_S:-320} python3 -m daemon.cli --read-only --state-dir $ST bench --model hf-llama --layers 8 \
      --shapes 1x2048,32x2048 --variants hf-eager,hf-compiled,hf-hwtune-unfused,hf-hwtune --budget-s 300 \
      --steps 32 --warmup 4 --check 4 --energy-window-s 2 --table "$table" --out "$OUT/hf" > "$OUT/hf.log" 2>&1
  echo "bench rc=$?" >> "$OUT/hf.log"
  for m in builtin hf; do cp "$OUT/$m/results.json" "$OUT/$m-results.json" 2>/dev/null; rm -rf "$OUT/$m"; done ;;
gaps)
  timeout 300 python3 bench/gaps_gpu.py --table "$table" --shapes 1x2048,32x2048 --out "$OUT" > "$OUT/gaps.log" 2>&1
  echo "gaps rc=$?" >> "$OUT/gaps.log"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_verifier_guards.py tests/test_gaps.py > "$OUT/gputests.txt" 2>&1
  timeout 150 python3 -m pytest -q -p no:cacheprovider -k "ptx or PTX" tests/test_kernel_linear_residual.py \
      tests/test_kernel_rmsnorm_linear.py tests/test_kernel_rmsnorm_gate_up_swiglu.py tests/test_linear_gemv.py >> "$OUT/gputests.txt" 2>&1 ;;
esac
ls -la "$OUT" | head -20
