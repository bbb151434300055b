"""`kvyard worker`: the engine behind an OpenAI-compatible HTTP server.

Flag names are vLLM's where the concept is the same, so a manifest written for
`vllm serve` needs few edits. Heavy imports (torch via the engine) stay inside
`run`, as the CLI table requires.
"""
from __future__ import annotations

import argparse
import json
import importlib
import importlib.util
import os
import re
from types import ModuleType
from typing import Any

from kvyard.common.wire import ROLES

from kvyard.workers.lora.config import add_lora_arguments, lora_config
from kvyard.workers.pd.flags import add_pd_arguments, pd_options

from .body import DEFAULT_MAX_BODY_BYTES

_KVCONNECTOR = "kvyard.workers.kvconnector"
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'1GiB', '512Mi', '2G', '4096': Kubernetes' convention (G = 10^9, Gi = 2^30),
    since the same values are written in the operator's manifests."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 512MiB, 2G)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive whole size: {text!r}")
    return int(value)


def _kvconnector() -> ModuleType | None:
    """The kvstore / P/D connector module, when it is part of this install."""
    try:
        if importlib.util.find_spec(_KVCONNECTOR) is None:
            return None
    except ModuleNotFoundError:
        return None
    return importlib.import_module(_KVCONNECTOR)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvyard.workers.engine.config import add_device_arguments

    p.add_argument("--model", default="demo",
                   help="'demo', a .gguf file, or a Hugging Face directory (never downloaded)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model'; the first is reported")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--max-model-len", type=parse_size, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--quantization", "-q", choices=("int8", "fp8", "int4", "gguf"), default=None,
                   help="weights: int8 (per-channel W8A16), fp8 (E4M3 per channel), int4 (group-wise, "
                        "32), quantized at load; gguf: a GGUF's Q4/Q8 blocks as stored (docs/quantization.md)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=parse_size, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=parse_size, default=None,
                   help="KV-cache capacity, e.g. 1GiB, 512MiB, 2G (G = 10^9, Gi = 2^30); default: "
                        "1GiB on CPU, --gpu-memory-utilization on CUDA")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8", "fp8_e4m3"), default="auto",
                   help="KV-cache storage: auto (the model's dtype); int8 or fp8 (E4M3), each with a scale "
                        "per token and head; fp8_e4m3: vLLM's bare E4M3 rows (no scale), the fast one on "
                        "a GPU (docs/kv-cache-dtype.md)")
    add_device_arguments(p)  # --device, --gpu-memory-utilization, --enforce-eager
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--role", choices=ROLES, default="both",
                   help="prefill | decode | both (disaggregated serving)")
    p.add_argument("--advertise-address", default=None, metavar="HOST:PORT",
                   help="address this worker is reached at (default $POD_IP:port, else "
                        "127.0.0.1:port); sent as x-kvyard-endpoint")
    p.add_argument("--max-body-bytes", type=parse_size, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted (413 beyond; default: the gateway's "
                        "4 MiB limit plus 64 KiB)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads (default: all cores)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="vLLM's sleep routes: POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping")
    p.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                   help="vLLM's KV-cache events for precise prefix routing, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
                        "\"tcp://*:5558\", \"topic\": \"kv@$POD_IP@model\"}' (off by default)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help="vLLM's speculative decoding config, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' or "
                        "'{\"method\": \"draft_model\", \"model\": \"demo\", \"draft_layers\": 8}' "
                        "(docs/speculative-decoding.md; off by default)")
    p.add_argument("--log-level", default="info")
    add_pd_arguments(p)
    add_lora_arguments(p)  # --enable-lora, --lora-modules, --max-loras, --max-lora-rank, --max-cpu-loras
    # --- kvstore hook: the connector module adds its own flags when it is installed.
    kv = _kvconnector()
    if kv is not None:
        kv.add_kv_arguments(p)


def _kv_events_config(text: str) -> Any:
    from kvyard.common.kv_events import KVEventsConfig

    try:
        return KVEventsConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative_config(text: str) -> dict:
    from kvyard.workers.engine.spec.config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)


def advertise_address(args: argparse.Namespace) -> str:
    if args.advertise_address:
        return args.advertise_address
    host = os.environ.get("POD_IP") or "127.0.0.1"
    return f"{host}:{args.port}"


def engine_config(args: argparse.Namespace) -> Any:
    from kvyard.workers.engine.config import EngineConfig, device_options

    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_dtype=args.kv_cache_dtype,
        **device_options(args),
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed, role=args.role,
        num_threads=args.num_threads, kv_hold_ttl_s=args.kv_hold_timeout,
        quantization=args.quantization, lora=lora_config(args),
        speculative_config=args.speculative_config)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import prometheus_client

    from kvyard.workers.engine.async_engine import AsyncLLMEngine

    from .serve import serve

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prometheus_client.disable_created_metrics()  # like vLLM: no *_created series to scrape
    config = engine_config(args)
    # --- kvstore hook: the connector is built before the engine, which binds its KV cache.
    kv = _kvconnector()
    if kv is not None:
        config.kv_connector = kv.build_connector(args, config)
    collectors = []
    if hasattr(config.kv_connector, "collector"):  # its metrics join the worker's /metrics
        collectors.append(config.kv_connector.collector())
    engine = AsyncLLMEngine(config)
    advertise = advertise_address(args)
    return asyncio.run(serve(engine, host=args.host, port=args.port, advertise=advertise,
                             pd=pd_options(args, advertise),
                             served_names=args.served_model_name, role=args.role,
                             max_body_bytes=args.max_body_bytes,
                             shutdown_timeout=args.shutdown_timeout,
                             extra_collectors=collectors,
                             enable_sleep_mode=args.enable_sleep_mode,
                             kv_events=args.kv_events_config))
