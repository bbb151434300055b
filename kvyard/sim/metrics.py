"""A simulated pod's `/metrics`: the worker's vLLM names (kvyard.common.wire), formatted by
hand from the engine's counters at scrape time. The EPP scrapes every pod every 50 ms;
a prometheus_client registry per pod would cost more than the whole simulated step."""
from __future__ import annotations

import time

from kvyard.common import wire
from kvyard.sim.pod import Pod


def render(pod: Pod) -> bytes:
    e = pod.engine
    c = e.counters
    m = f'model_name="{pod.served[0]}"'
    lines = [
        f"# TYPE {wire.M_RUNNING} gauge", f"{wire.M_RUNNING}{{{m}}} {len(e.running)}",
        f"# TYPE {wire.M_WAITING} gauge", f"{wire.M_WAITING}{{{m}}} {len(e.waiting)}",
        f"# TYPE {wire.M_KV_USAGE} gauge", f"{wire.M_KV_USAGE}{{{m}}} {e.pool.usage:.6f}",
        f"# TYPE {wire.M_PROMPT_TOKENS_PENDING} gauge",
        f"{wire.M_PROMPT_TOKENS_PENDING}{{{m}}} {e.prompt_tokens_pending}",
        f"# TYPE {wire.M_CACHE_CONFIG} gauge",
        f'{wire.M_CACHE_CONFIG}{{{m},block_size="{e.pool.block_size}",'
        f'num_gpu_blocks="{e.pool.capacity}"}} 1.0',
        f"# TYPE {wire.M_PROMPT_TOKENS} counter", f"{wire.M_PROMPT_TOKENS}{{{m}}} {c.prompt_tokens}",
        f"# TYPE {wire.M_GENERATION_TOKENS} counter",
        f"{wire.M_GENERATION_TOKENS}{{{m}}} {c.generation_tokens}",
        f"# TYPE {wire.M_PREFIX_QUERIES} counter",
        f"{wire.M_PREFIX_QUERIES}{{{m}}} {e.pool.prefix_queries_tokens}",
        f"# TYPE {wire.M_PREFIX_HITS} counter",
        f"{wire.M_PREFIX_HITS}{{{m}}} {e.pool.prefix_hits_tokens}",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{m}}} {c.preemptions}",
        f"# TYPE {wire.M_REQUEST_SUCCESS} counter",
        *(f'{wire.M_REQUEST_SUCCESS}{{{m},finished_reason="{r}"}} {n}'
          for r, n in c.success.items()),
        f"# TYPE {wire.M_WORKER_INFO} gauge",
        f'{wire.M_WORKER_INFO}{{{m},role="{pod.role}",simulated="true",'
        f'profile="{pod.profile_name}"}} 1.0',
        # wall seconds x this = simulated seconds: what a client's timings mean here
        "# TYPE kvyard:sim_time_scale gauge", f"kvyard:sim_time_scale {e.model.time_scale:g}",
    ]
    if e.lora is not None:
        lines += _lora_info(pod)
    if pod.publisher is not None:
        lines += [f"# TYPE {wire.M_KV_EVENT_BATCHES} counter",
                  f"{wire.M_KV_EVENT_BATCHES} {pod.publisher.batches}"]
    if pod.role == "decode" or pod.handoffs or pod.fallbacks:
        lines += [f"# TYPE {wire.M_PD_HANDOFFS} counter",
                  f'{wire.M_PD_HANDOFFS}{{path="sim"}} {pod.handoffs}',
                  f"# TYPE {wire.M_PD_FALLBACKS} counter",
                  f'{wire.M_PD_FALLBACKS}{{reason="prefill_failed"}} {pod.fallbacks}',
                  f"# TYPE {wire.M_PD_REJECTED} counter", f"{wire.M_PD_REJECTED} {pod.rejected}"]
    return ("\n".join(lines) + "\n").encode()


def _lora_info(pod: Pod) -> list[str]:
    """vLLM's `vllm:lora_requests_info`: the adapters of running and waiting requests (its
    value is the time of the update, as vLLM's `set_to_current_time`); plus the
    simulator's own load counter, what `kvyard bench lora` counts as thrash."""
    e = pod.engine
    running = ",".join(dict.fromkeys(r.adapter for r in e.running if r.adapter))
    waiting = ",".join(dict.fromkeys(r.adapter for r in e.waiting if r.adapter))
    return [f"# TYPE {wire.M_LORA_INFO} gauge",
            f'{wire.M_LORA_INFO}{{max_lora="{e.lora.max_loras}",'
            f'waiting_lora_adapters="{waiting}",running_lora_adapters="{running}"}} '
            f"{time.time():.3f}",
            "# TYPE kvyard:sim_lora_loads_total counter",
            f"kvyard:sim_lora_loads_total {e.lora.loads}"]
