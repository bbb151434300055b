"""Latency profiles: the numbers a simulated pod's latency model runs on, and their sources.

All durations are seconds of simulated time. The model (`latency.py`):
  TTFT  = prefill_overhead + uncached prompt tokens x prefill_time_per_token
  ITL   = inter_token_latency + (running sequences - 1) x itl_per_running_seq
  P/D   = kv_transfer_latency + transferred tokens x kv_transfer_time_per_token
each with a normal jitter of the given standard deviation (clamped as llm-d-inference-sim
clamps it: never more than 70% off the mean). A step's token budget
(`max_num_batched_tokens`) splits long prompts into chunks, as vLLM's and kvyard's chunked
prefill do: cpu-demo keeps `kvyard worker`'s default (1,024), the GPU profiles vLLM's
default for `vllm serve` on 70+ GiB GPUs (8,192).

Built-in profiles:
- `cpu-demo`: the demo model on kvyard's CPU worker (2 cores), measured by `kvyard sim
  calibrate` (defaults: prompts of 16/256/1,024 tokens x3, 1 and 4 streams of 32 tokens) on
  the 2-core dev box on 2026-12-05: TTFT 92 ms + 0.89 ms per prompt token (docs/benchmarks.md
  agrees: a cold 2,000-token prompt 1.59 s), ITL 16.2 ms + 0.76 ms per extra stream. The
  prefill jitter is set to 20 ms, not the fit's 0.14 s residual (other jobs shared the box
  during the run). P/D transfer is not measured (no peer): 5 ms + 20 us per token, a
  loopback-TCP guess. Re-measure with `kvyard sim calibrate --out F`, load with
  `--profile F`.
- `h100`: llm-d-inference-sim's "8B-class model on H100, balanced load" per-token profile
  (docs/latency-profiles.md, manifests/latency-profiles/8b-h100-balanced-per-token.yaml):
  prefill-overhead 30 ms, prefill-time-per-token 250 us (std 5 ms), inter-token-latency 12 ms
  (std 2 ms), kv-cache-transfer-time-per-token 3 us (std 200 us), max-num-seqs 16 and
  time-factor-under-load 2.0, i.e. ITL doubles at 16 running: 0.8 ms per extra sequence.
- `h200`: kvyard's own engine on one H200, 8B shape (docs/benchmarks.md, "Online serving",
  `--max-num-seqs 128`): decode step 5.13 ms at 1 stream and 22.8 ms at 128, so 0.139 ms per
  extra sequence; TTFT 16 ms for a 512-token prompt at 1 stream, so with the decode step as
  the fixed cost (5.13 ms) 0.0212 ms per prompt token. P/D transfer: llm-d-inference-sim's
  NVLink row for an 8B model (~0.2 us per token, 100-500 us setup: 0.3 ms).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(slots=True)
class LatencyProfile:
    name: str
    prefill_overhead: float
    prefill_time_per_token: float
    inter_token_latency: float
    itl_per_running_seq: float = 0.0
    prefill_time_std_dev: float = 0.0
    inter_token_latency_std_dev: float = 0.0
    kv_transfer_latency: float = 0.0
    kv_transfer_time_per_token: float = 0.0
    kv_transfer_std_dev: float = 0.0
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192  # the step's token budget (chunked prefill)
    source: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> "LatencyProfile":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"latency profile: unknown field(s) {', '.join(unknown)}")
        prof = cls(**doc)
        for f in fields(cls):
            v = getattr(prof, f.name)
            if f.name not in ("name", "source") and (not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"latency profile: {f.name} must be a number >= 0, got {v!r}")
        return prof

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


BUILTIN: dict[str, LatencyProfile] = {
    "cpu-demo": LatencyProfile(
        name="cpu-demo", prefill_overhead=0.092, prefill_time_per_token=0.00089,
        inter_token_latency=0.0162, itl_per_running_seq=0.00076,
        prefill_time_std_dev=0.02, inter_token_latency_std_dev=0.0053,
        kv_transfer_latency=0.005, kv_transfer_time_per_token=0.00002, max_num_seqs=32,
        max_num_batched_tokens=1024,
        source="kvyard sim calibrate, demo model on the 2-core dev box, 2026-12-05"),
    "h100": LatencyProfile(
        name="h100", prefill_overhead=0.030, prefill_time_per_token=0.000250,
        inter_token_latency=0.012, itl_per_running_seq=0.0008,
        prefill_time_std_dev=0.005, inter_token_latency_std_dev=0.002,
        kv_transfer_latency=0.0, kv_transfer_time_per_token=0.000003,
        kv_transfer_std_dev=0.0002, max_num_seqs=16,
        source="llm-d-inference-sim docs/latency-profiles.md, 8b-h100-balanced-per-token"),
    "h200": LatencyProfile(
        name="h200", prefill_overhead=0.00513, prefill_time_per_token=0.0000212,
        inter_token_latency=0.00513, itl_per_running_seq=0.000139,
        prefill_time_std_dev=0.001, inter_token_latency_std_dev=0.0003,
        kv_transfer_latency=0.0003, kv_transfer_time_per_token=0.0000002, max_num_seqs=128,
        source="docs/benchmarks.md 'Online serving' (kvyard engine, H200, 8B shape); "
               "P/D transfer: llm-d-inference-sim's NVLink row"),
}


def load_profile(ref: str) -> LatencyProfile:
    """A built-in profile's name or a JSON file (as `kvyard sim calibrate` writes)."""
    if ref in BUILTIN:
        p = BUILTIN[ref]
        return LatencyProfile.from_json(p.to_json())  # a copy: flags may override fields
    path = Path(ref)
    if not path.is_file():
        raise ValueError(f"unknown latency profile {ref!r}: one of {', '.join(BUILTIN)} "
                         "or a JSON file")
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a latency profile is a JSON object")
    return LatencyProfile.from_json(doc)
