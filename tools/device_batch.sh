#!/bin/bash
# Several tools/device_gpu.sh stages in one device call, each with its own time limit:
#   bash tools/device_batch.sh "SECONDS STAGE [ARGS...]" ["SECONDS STAGE [ARGS...]" ...]
# A stage runs in its own session and is killed whole (python, tee and all) at its limit, so a
# slow stage cannot run on beside the next one and skew its timings (plain `timeout` would only
# kill the stage's bash). Each stage ends with a line saying how it ended. Words split on spaces:
# an argument cannot hold one (pytest -k EXPR with spaces needs device_gpu.sh itself).
set -u
for spec in "$@"; do
  read -r -a words <<< "$spec"
  limit=${words[0]}
  start=$(date +%s)
  setsid bash tools/device_gpu.sh "${words[@]:1}" &
  pid=$!
  ( sleep "$limit"; kill -9 -- "-$pid" 2>/dev/null ) &
  watcher=$!
  wait "$pid"
  rc=$?
  kill "$watcher" 2>/dev/null
  echo "== ${words[*]:1:2}: rc $rc after $(( $(date +%s) - start )) s (limit $limit s)"
done
