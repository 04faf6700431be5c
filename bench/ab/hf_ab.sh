#!/bin/bash
# A/B of the transformers patch: HEAD's integration against 81e0284's (before this session's hf
# fixes), hf-llama rows alternating new, old, new, old on one machine. Before the device call, here:
#   git show 81e0284:kernelsearch/integrations/transformers.py > bench/ab/transformers_old.py
# (not committed: a copy of an old module; the device copy of the tree carries it untracked).
set -u; export PYTHONUNBUFFERED=1 HWTUNE_READ_ONLY=1 PYTHONPATH=$PWD
cp kernelsearch/integrations/transformers.py /tmp/transformers_new.py
for which in new old new old; do
  [ $which = old ] && cp bench/ab/transformers_old.py kernelsearch/integrations/transformers.py || cp /tmp/transformers_new.py kernelsearch/integrations/transformers.py
  rm -rf /tmp/ab-state /tmp/ab-o; cp bench/results/h100-issue13/run25/dispatch-judged.json /tmp/ab-table.json
  timeout 110 python3 -m daemon.cli --read-only --state-dir /tmp/ab-state bench --model hf-llama --layers 8 \
    --shapes 1x2048,32x2048 --variants hf-compiled,hf-hwtune --budget-s 100 --steps 32 --warmup 4 --check 4 \
    --energy-window-s 0 --table /tmp/ab-table.json --out /tmp/ab-o > /tmp/ab-$which.txt 2>&1
  echo "== $which rc=$?"; grep -E "^(hf compiled|hwtune patched)" /tmp/ab-$which.txt
done
cp /tmp/transformers_new.py kernelsearch/integrations/transformers.py
