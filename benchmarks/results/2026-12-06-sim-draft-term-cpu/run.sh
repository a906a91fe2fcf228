#!/bin/bash
# $1: a checkout of the commit to check (its benchmarks/results holds the runs named below); prints each
# run's simulated-against-measured rows (benchmarks.sim_replay, in and out of sample, both fits)
R=benchmarks/results
S1=$R/2026-12-05-seed1-h200/trace64.jsonl
T48=$R/2026-12-06-h200-ahead-drawn-48l/trace48.jsonl
cd "$1"
for pair in "2026-12-06-h200-ahead-drawn-48l/t48.json $T48" "2026-12-06-h200-drafts-48l/t48.json $T48" \
  "2026-12-06-h200-ahead-drawn-48l/g1.json $S1" "2026-12-06-h200-ahead-drawn-48l/t1.json $S1" \
  "2026-12-06-h200-drafts-48l/inter64.json $S1" "2026-12-06-h200-drafts-48l/t1.json $S1" \
  "2026-12-05-chunked-drafts-h100/inter64.json $S1" "2026-12-05-chunked-drafts-h100/sync64.json $S1" \
  "2026-12-05-seed1-h200/inter64.json $S1" "2026-12-05-seed1-h200/drafts64.json $S1"; do
  set -- $pair
  echo "== $1"
  PYTHONPATH=. nice -n 10 timeout 300 python -m benchmarks.sim_replay $R/$1 --trace $2 2>&1 | grep -E "^\S+ +[0-9]+ " | grep -v "^schedule"
done
