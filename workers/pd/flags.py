"""The worker's P/D flags (no heavy imports: the CLI table imports this to build --help)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(slots=True)
class PDOptions:
    role: str = "both"
    key_file: str | None = None          # None: $KVYARD_PD_KEY_FILE, else no key
    peer_host: str = "127.0.0.1"         # where the peer server listens
    peer_port: int = 0                   # 0: an ephemeral port
    advertise_host: str = "127.0.0.1"    # remote_host in offers
    prefill_timeout_s: float = 60.0
    transfer_timeout_s: float = 30.0
    transports: tuple[str, ...] = ("shm", "tcp")
    stream: bool = True                  # pull while the prefill computes (peer_stream.py)


def add_pd_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("P/D disaggregation")
    g.add_argument("--pd-key-file", default=None,
                   help="key shared with the EPP that signs prefill targets (default "
                        "$KVYARD_PD_KEY_FILE; without one, x-prefiller-host-port is refused)")
    g.add_argument("--kv-peer-port", type=int, default=0,
                   help="port of the peer KV transfer endpoint decode workers pull from "
                        "(prefill and both roles; 0: an ephemeral port)")
    g.add_argument("--pd-prefill-timeout", type=float, default=60.0,
                   help="seconds a decode worker waits for the prefill leg before "
                        "prefilling itself")
    g.add_argument("--pd-transfer-timeout", type=float, default=30.0,
                   help="seconds a decode worker gives the KV pull before prefilling itself")
    g.add_argument("--pd-transports", type=_transports, default=("shm", "tcp"),
                   help="peer transports a decode worker tries, in order (comma-separated: "
                        "shm = a buffer a prefill worker on this host writes into, tcp; "
                        "none = no pull, blocks only from the shared kvstore tier; "
                        "default shm,tcp)")
    g.add_argument("--no-pd-stream", dest="pd_stream", action="store_false",
                   help="pull a prefill's blocks only once it has answered (default: stream "
                        "them while the prefill worker still computes the prompt)")
    g.add_argument("--kv-hold-timeout", type=float, default=120.0,
                   help="seconds a prefill worker keeps a prompt's blocks for a pull")


def _transports(value: str) -> tuple[str, ...]:
    if value.strip() == "none":
        return ()
    out = tuple(t.strip() for t in value.split(",") if t.strip())
    bad = [t for t in out if t not in ("shm", "tcp")]
    if bad or not out or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"expected shm and/or tcp, comma-separated, or none: "
                                         f"{value!r}")
    return out


def pd_options(args: argparse.Namespace, advertise: str) -> PDOptions:
    return PDOptions(role=args.role, key_file=args.pd_key_file, peer_host=args.host,
                     peer_port=args.kv_peer_port, advertise_host=advertise.rpartition(":")[0],
                     prefill_timeout_s=args.pd_prefill_timeout,
                     transfer_timeout_s=args.pd_transfer_timeout,
                     transports=args.pd_transports, stream=args.pd_stream)
