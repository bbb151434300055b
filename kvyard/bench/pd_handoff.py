"""`kvyard bench pd`'s handoff figures: what the decode worker's metrics say a phase of
handoffs cost (per transport: the same-host memfd, TCP), and the loopback TCP baseline
between the same two cores, measured in the same run.

A handoff's time, as the decode worker splits it (`kvyard:pd_handoff_phase_seconds`):
the prefill leg's HTTP round trip (the prefill itself, mostly), the hold's claim (connect
to the ok), the transfer (to the last byte; on the memfd path verification of earlier
chunks overlaps it), the verification left after it, and the engine's insert into its
cache; a streamed handoff has, instead of claim, transfer and verify, its tail (from
learning that the prefill ended to the last block verified), which is also what its
handoff histogram times. Bandwidth is the KV bytes over the pull (claim + transfer + verify), as the
handoff histogram measures it; for the Redis path (`pd-redis`: no pull, the blocks the
prefill worker saved to a shared Redis tier) over the store read.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from kvyard.common import wire

PHASES = ("prefill_leg", "claim", "transfer", "verify", "insert", "stream_tail")
TRANSPORTS = ("shm", "tcp")


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def stats(after: dict[str, float], before: dict[str, float], path: str = "peer") -> dict:
    """A phase's handoffs by `path` (peer, store) from two scrapes of the decode worker."""
    cnt = f'{wire.M_PD_HANDOFF_SECONDS}_count{{path="{path}"}}'
    sec = f'{wire.M_PD_HANDOFF_SECONDS}_sum{{path="{path}"}}'
    out = {"path": path, "handoffs": _delta(after, before, cnt), "bytes": _delta(after, before,
                                                                   wire.M_PD_HANDOFF_BYTES),
           "seconds": _delta(after, before, sec),
           "transports": {t: _delta(after, before, f'{wire.M_PD_TRANSFERS}{{transport="{t}"}}')
                          for t in TRANSPORTS},
           "phases_ms": {},
           "streamed": {w: _delta(after, before, f'{wire.M_PD_STREAMED_BLOCKS}{{when="{w}"}}')
                        for w in ("during_prefill", "after_prefill")}}
    for ph in PHASES:
        n = _delta(after, before, f'{wire.M_PD_PHASE_SECONDS}_count{{phase="{ph}"}}')
        s = _delta(after, before, f'{wire.M_PD_PHASE_SECONDS}_sum{{phase="{ph}"}}')
        out["phases_ms"][ph] = s / n * 1e3 if n else float("nan")
    n, secs = out["handoffs"], out["seconds"]
    out["gbps"] = out["bytes"] / secs / 1e9 if secs else float("nan")
    out["seconds_mean"] = secs / n if n else float("nan")
    return out


def note(setup: str, phase: str, ph: dict, prefill_alone_s: float, lo: float,
         lo_fresh: float) -> str:
    n = ph["handoffs"]
    used = ", ".join(f"{t} {v:.0f}" for t, v in ph["transports"].items() if v) or "none"
    parts = " / ".join(f"{k} {v:.0f}" for k, v in ph["phases_ms"].items() if v == v)
    head = (f"{setup} {phase}: {n:.0f} {ph['path']} handoffs ({used}), "
            f"{ph['bytes'] / n / 1e6 if n else 0:.1f} MB each, ")
    during, after = ph["streamed"]["during_prefill"], ph["streamed"]["after_prefill"]
    if during + after:   # streamed: what is left after the prefill is the handoff's cost
        return (head + f"streamed: {during / (during + after):.0%} of the blocks arrived "
                f"while the prefill ran; tail after it {ph['seconds_mean'] * 1e3:.1f} ms mean "
                f"({ph['seconds_mean'] / prefill_alone_s:.1%} of the prefill alone, "
                f"{prefill_alone_s * 1e3:.0f} ms); mean ms by phase: {parts}")
    return (head + f"pull {ph['seconds_mean'] * 1e3:.0f} ms mean "
            f"({ph['seconds_mean'] / prefill_alone_s:.1%} of the prefill alone, "
            f"{prefill_alone_s * 1e3:.0f} ms); {ph['gbps']:.2f} GB/s = "
            f"{ph['gbps'] / lo:.0%} of loopback TCP between the same cores "
            f"({lo:.2f} GB/s into a reused buffer, measured beside this setup's idle handoffs; "
            f"target >= 50%), "
            f"{ph['gbps'] / lo_fresh:.0%} of it into a fresh handoff-sized buffer "
            f"({lo_fresh:.2f} GB/s); mean ms by phase: {parts}")


def loopback(cpus: list[int], idle: dict) -> dict[str, float]:
    """Best of three (a ceiling, on a machine other work shares) into a reused buffer,
    and into a fresh one the size of the idle handoffs."""
    size = idle["bytes"] / idle["handoffs"] if idle["handoffs"] else 96e6
    return {"loopback_gbps": max(loopback_gbps(*cpus) for _ in range(3)),
            "loopback_fresh_gbps": max(loopback_gbps(*cpus, mib=max(1, int(size) >> 20),
                                                     fresh=True) for _ in range(3))}


_SENDER = """
import os, socket, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
c = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
buf = bytearray(1 << 20)
for _ in range(int(sys.argv[3])):
    c.sendall(buf)
c.close()
"""


def loopback_gbps(send_cpu: int, recv_cpu: int, mib: int = 512, fresh: bool = False) -> float:
    """One TCP connection over loopback between two processes pinned as the prefill
    and decode workers are: sendall of 1 MiB buffers, recv_into a reused 4 MiB buffer
    (the socket's ceiling), or with `fresh` into one new buffer of the whole size, as
    a handoff receives (its pages are faulted in and miss the cache)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    out: list[float] = []

    def receive() -> None:
        os.sched_setaffinity(0, {recv_cpu})  # this thread only
        conn, _ = srv.accept()
        import numpy as np

        sink = memoryview(np.empty((mib << 20) if fresh else (4 << 20), dtype=np.uint8))
        got, t0 = 0, time.perf_counter()
        while (k := conn.recv_into(sink[got:] if fresh else sink)) > 0:
            got += k
        out.append(got / (time.perf_counter() - t0) / 1e9)
        conn.close()
    t = threading.Thread(target=receive)
    t.start()
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, str(send_cpu),
                               str(srv.getsockname()[1]), str(mib)])
    sender.wait(120)
    t.join(120)
    srv.close()
    return out[0] if out else float("nan")
