"""Many stand-in pods in one process, for measuring what the EPP pays to watch a pool.

The EPP scrapes every pod's `/metrics` at its scrape interval; 256 stand-in
processes would cost the machine more than the EPP being measured, so one
asyncio process serves the stand-in app (`kvyard.stack.standin.make_app`) on
each of the given ports. Run: `python -m kvyard.bench.route_pods --ports P1 P2 ...`.
"""
from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

from kvyard.common.models import DEMO_SERVED_NAME
from kvyard.stack.standin import StandinState, make_app


async def serve(host: str, ports: list[int]) -> None:
    runners = []
    for port in ports:
        runner = web.AppRunner(make_app(StandinState(address=f"{host}:{port}",
                                                     model=DEMO_SERVED_NAME)),
                               access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
    try:
        await asyncio.Event().wait()  # until the process is signalled
    finally:
        for r in runners:
            await r.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--ports", type=int, nargs="+", required=True)
    a = p.parse_args(argv)
    try:
        asyncio.run(serve(a.host, a.ports))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
