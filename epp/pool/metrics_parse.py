"""Reads the few vLLM gauges the scheduler needs from Prometheus text.

A full exposition parser costs far more than the scheduler itself at a 50 ms
scrape interval over dozens of pods; we only look at lines that start with
one of five names (and kvyard's sleep gauge) and ignore everything else (comments, histograms, labels we
do not use). Values from several label sets (e.g. several engines in one
pod) are summed for queue/running and maxed for KV usage.

Three counters feed the KEDA scaler's online capacity measurement
(`scaler/capacity.py`): prompt tokens prefilled, tokens generated, requests finished
(summed over label sets; None when the worker does not export them). The prefix-cache
hit and query counters are read too, for `kvyard bench route`'s pool hit rate.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvyard.common.wire import (M_CACHE_CONFIG, M_GENERATION_TOKENS, M_KV_USAGE, M_KV_USAGE_OLD,
                                M_LORA_INFO, M_PREFIX_HITS, M_PREFIX_QUERIES, M_PROMPT_TOKENS,
                                M_PROMPT_TOKENS_PENDING, M_REQUEST_SUCCESS, M_RUNNING, M_SLEEPING,
                                M_WAITING)

_COUNTERS = {M_PROMPT_TOKENS: "prompt_tokens", M_GENERATION_TOKENS: "generation_tokens",
             M_REQUEST_SUCCESS: "finished", M_PREFIX_HITS: "prefix_hits",
             M_PREFIX_QUERIES: "prefix_queries"}


@dataclass(slots=True)
class WorkerMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    seen: int = 0  # how many wanted lines were found; 0 means "not a vLLM endpoint"
    sleeping: bool = False  # kvyard:sleeping 1 (sleep mode): no traffic
    prompt_tokens: float | None = None  # vllm:prompt_tokens_total
    generation_tokens: float | None = None  # vllm:generation_tokens_total
    finished: float | None = None  # vllm:request_success_total, all finish reasons
    prefix_hits: float | None = None  # vllm:prefix_cache_hits_total (tokens)
    prefix_queries: float | None = None  # vllm:prefix_cache_queries_total (tokens)
    prompt_tokens_pending: float | None = None  # kvyard:prompt_tokens_pending (kvyard workers)
    # vllm:lora_requests_info, the series with the latest timestamp value (vLLM keeps old
    # label sets; GAIE reads the newest): adapters of running / waiting requests, max_lora.
    # None: the worker serves no adapters.
    lora_running: frozenset[str] | None = None
    lora_waiting: frozenset[str] = frozenset()
    max_lora: int | None = None
    _lora_time: float = -1.0


def _value(line: str) -> float:
    # "name{labels} value [timestamp]" — the value is the token after the labels.
    rest = line[line.rindex("}") + 1:] if "}" in line else line.split(" ", 1)[1]
    return float(rest.split()[0])


def _label(line: str, key: str) -> str | None:
    i = line.find(key + '="')
    if i < 0:
        return None
    i += len(key) + 2
    return line[i:line.index('"', i)]


def _adapters(line: str, key: str) -> frozenset[str]:
    return frozenset(a for a in (_label(line, key) or "").split(",") if a)


def _lora(m: WorkerMetrics, line: str) -> None:
    t = _value(line)
    if t < m._lora_time:
        return
    ml = _label(line, "max_lora")
    m._lora_time = t
    m.lora_running = _adapters(line, "running_lora_adapters")
    m.lora_waiting = _adapters(line, "waiting_lora_adapters")
    m.max_lora = int(ml) if ml and ml.isdigit() else m.max_lora


def parse_vllm_metrics(text: str) -> WorkerMetrics:
    m = WorkerMetrics()
    kv_new: float | None = None
    kv_old: float | None = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            try:
                if line.startswith(M_SLEEPING):
                    m.sleeping = m.sleeping or _value(line) > 0
                elif line.startswith(M_PROMPT_TOKENS_PENDING):
                    m.prompt_tokens_pending = (m.prompt_tokens_pending or 0.0) + _value(line)
            except (ValueError, IndexError):
                pass
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            if name == M_WAITING:
                m.waiting += _value(line)
            elif name == M_RUNNING:
                m.running += _value(line)
            elif name == M_KV_USAGE:
                kv_new = max(kv_new or 0.0, _value(line))
            elif name == M_KV_USAGE_OLD:
                kv_old = max(kv_old or 0.0, _value(line))
            elif name == M_CACHE_CONFIG:
                bs, nb = _label(line, "block_size"), _label(line, "num_gpu_blocks")
                m.block_size = int(bs) if bs and bs.isdigit() else m.block_size
                m.num_gpu_blocks = int(nb) if nb and nb.isdigit() else m.num_gpu_blocks
            elif name == M_LORA_INFO:
                _lora(m, line)
            elif name in _COUNTERS:
                attr = _COUNTERS[name]
                setattr(m, attr, (getattr(m, attr) or 0.0) + _value(line))
            else:
                continue
        except (ValueError, IndexError):
            continue  # one malformed line must not hide the rest
        m.seen += 1
    kv = kv_new if kv_new is not None else kv_old
    m.kv_usage = min(1.0, max(0.0, kv or 0.0))
    return m
