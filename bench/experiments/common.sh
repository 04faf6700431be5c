# Sourced by bench/experiments/*_gpu.sh: `. bench/experiments/common.sh NAME`. Read-only runs
# (HWTUNE_READ_ONLY=1), $OUT (default out/NAME) with everything printed also in $OUT/run.log, a
# fresh state directory $ST (/tmp/NAME-state), and $name, the card's name.
set -u -o pipefail
export PYTHONUNBUFFERED=1 HWTUNE_READ_ONLY=1 PYTHONPATH=$PWD
OUT=${OUT:-out/$1}; mkdir -p "$OUT"
ST=/tmp/$1-state; rm -rf $ST; mkdir -p $ST
exec > >(tee -a "$OUT/run.log") 2>&1
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
date -u; echo "commit ${COMMIT:-unknown}; $name"
