# Sourced by bench/experiments/*_gpu.sh: `. bench/experiments/common.sh NAME`. Read-only runs
# (HWTUNE_READ_ONLY=1), $OUT (default out/NAME) with everything printed also in $OUT/run.log, a
# fresh state directory $ST (/tmp/NAME-state), and $name, the card's name; then the helpers the
# scripts share: candidate, rows, judge, merge_json.
set -u -o pipefail
export PYTHONUNBUFFERED=1 HWTUNE_READ_ONLY=1 PYTHONPATH=$PWD
OUT=${OUT:-out/$1}; mkdir -p "$OUT"
ST=/tmp/$1-state; rm -rf $ST; mkdir -p $ST
exec > >(tee -a "$OUT/run.log") 2>&1
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
date -u; echo "commit ${COMMIT:-unknown}; $name"

candidate() {  # candidate NAME: the template with bench/experiments/NAME.patch applied -> $ST/NAME.py (printed)
  python3 bench/experiments/candidate.py "$1" "$ST/$1.py" && echo "$ST/$1.py"
}

rows() {  # rows TABLE SHAPES LABEL: the built-in rows (tuned-nopdl, tuned) on TABLE -> $ST/rows-LABEL.json
  timeout 60 python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes "$2" --variants tuned-nopdl,tuned --budget-s 50 --energy-window-s 0 \
      --table "$1" --out $ST/b > $ST/b.log 2>&1
  echo "rows $3 rc=$?"; grep -E "^(variant|tuned)" $ST/b.log | sed "s/^/$3 /"
  cp $ST/b/results.json "$ST/rows-$3.json"; rm -rf $ST/b
}

judge() {  # judge TABLE SHAPES TOP JSON: the step judge on TABLE (written back in place), its
  # results -> JSON; JUDGE_S (default 170) bounds it
  local s=${JUDGE_S:-170}
  timeout $s python3 -m daemon.cli --read-only --state-dir $ST bench --model builtin --layers 8 \
      --shapes "$2" --variants tuned --judge-in-step --judge-top $3 --budget-s $((s - 10)) \
      --energy-window-s 0 --table "$1" --out $ST/j > $ST/j.log 2>&1
  echo "judge rc=$?"; grep "step judge" $ST/j.log | cut -c1-1600
  cp $ST/j/results.json "$4"; rm -rf $ST/j "$1.lock"
}

merge_json() {  # merge_json OUT FILE...: every FILE's JSON into OUT, keyed by file name
  python3 -c "import json, sys, pathlib; pathlib.Path(sys.argv[1]).write_text(json.dumps({pathlib.Path(f).stem: json.loads(pathlib.Path(f).read_text()) for f in sys.argv[2:]}))" "$@"
}
