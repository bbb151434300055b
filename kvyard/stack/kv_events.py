"""Each local worker's KV-event publisher, and where the EPP finds it.

`kvyard up` gives every worker (real or simulated) a ZMQ PUB and replay ROUTER of its
own on loopback ports (`--kv-events-config`, vLLM's JSON; a wildcard endpoint, as vLLM
binds only those) and writes each endpoint's pair into the EPP's endpoints file
(`kv_events`, `kv_events_replay`), so the EPP's default `precise-prefix-cache` scorer
routes by what each engine really holds. Ports are two runs of consecutive free ports:
a sim process with several pods offsets one flag's ports by each pod's index.

Stand-in workers publish nothing, and neither do scale-to-zero pools (their workers come
and go on ports the autoscaler picks): those endpoints are scored approximately. A user's
own `--zmq-endpoint`/`--kv-events-config` in `--sim-args` wins over this.

Several models (`--model NAME=SOURCE`, stack/models.py): every pool's workers publish alike,
each pool with ports of its own; the EPP keys each pool's prompts with that pool's tokenizer.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from kvyard.stack import procs
from kvyard.stack.spec import StackSpec

_OWN_FLAGS = ("--zmq-endpoint", "--kv-events-config")


def port_run(n: int, taken: set[int], rng: random.Random | None = None) -> int:
    """The first of `n` consecutive free ports (recorded in `taken`)."""
    rng = rng or random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        run = range(base, base + n)
        if not taken.intersection(run) and all(procs.port_free(p) for p in run):
            taken.update(run)
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


@dataclass(slots=True)
class EventPorts:
    """Worker `i` publishes on `pub + i` and answers replays on `replay + i`."""

    pub: int
    replay: int

    @classmethod
    def allocate(cls, n: int, taken: set[int]) -> "EventPorts":
        return cls(port_run(n, taken), port_run(n, taken))

    def flag(self, i: int = 0) -> list[str]:
        """`--kv-events-config` for worker `i` (a sim process: its first pod's index 0,
        the simulator offsets the rest)."""
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
               "endpoint": f"tcp://*:{self.pub + i}",
               "replay_endpoint": f"tcp://*:{self.replay + i}"}
        return ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]

    def streams(self, addresses: list[str]) -> dict[str, tuple[str, str]]:
        """Each address's (PUB, replay) as the EPP connects to them."""
        return {a: (f"tcp://127.0.0.1:{self.pub + i}", f"tcp://127.0.0.1:{self.replay + i}")
                for i, a in enumerate(addresses)}


def wanted(spec: StackSpec) -> bool:
    """Whether this stack's workers publish KV events (module docstring)."""
    if not spec.kv_events or spec.standin or spec.scale_to_zero:
        return False
    return not any(a.split("=")[0] in _OWN_FLAGS for a in spec.sim_args)
