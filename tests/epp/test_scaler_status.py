"""`kvyard status` shows what KEDA sees: it asks the EPP's scaler over gRPC, per role."""
from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

from kvyard.epp.flow.demand import Demand
from kvyard.epp.observability import EppMetrics, debug_app
from kvyard.epp.pool.endpoints import EndpointPool
from kvyard.epp.scaler.server import ScalerServer
from kvyard.stack import status
from kvyard.stack.launch import StackState


async def _status(run_dir, *flags: str) -> str:
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvyard.cli", "status", *flags, "--run-dir", str(run_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 60)
    assert p.returncode == 0, err.decode()
    return out.decode()


async def test_status_json_and_text_show_the_scaler(tmp_path, free_port):
    pool, demand = EndpointPool(), Demand()
    scaler = ScalerServer(pool, demand, "mypool")
    sport = await scaler.start("127.0.0.1", 0)
    # the EPP's real /debug/endpoints app, reporting the scaler as EppApp._debug does
    runner = web.AppRunner(debug_app(EppMetrics(), pool, lambda: {"scaler": scaler.snapshot()}))
    await runner.setup()
    mport = free_port()
    await web.TCPSite(runner, "127.0.0.1", mport).start()
    try:
        StackState(run_dir=str(tmp_path), gateway_url="http://127.0.0.1:1", admin_url="",
                   epp_metrics_url=f"http://127.0.0.1:{mport}", endpoints=[], procs=[],
                   spec={"prefill": 1, "decode": 1}).save()
        demand.parked["decode"] = 2  # held at zero pods
        doc = json.loads(await _status(tmp_path, "--json"))
        sc = doc["scaler"]
        assert sc["address"] == f"127.0.0.1:{sport}"
        assert [(p["pool"], p["role"], p["metadata"], p["active"]) for p in sc["pools"]] == [
            ("mypool", "prefill", {"pool": "mypool", "role": "prefill"}, False),
            ("mypool", "decode", {"pool": "mypool", "role": "decode"}, True)]
        prefill, decode = (p["metric"] for p in sc["pools"])
        assert prefill == 0.0 and decode > 0.0
        text = (await _status(tmp_path)).splitlines()
        line = next(x for x in text if x.startswith("scaler: "))
        assert line.startswith(f"scaler: 127.0.0.1:{sport} pool mypool: prefill idle metric 0.00")
        assert ", decode active metric " in line
    finally:
        await runner.cleanup()
        await scaler.stop()


async def test_scaler_view_reports_refusals_and_absence(free_port):
    scaler = ScalerServer(EndpointPool(), Demand(), "mypool")
    sport = await scaler.start("127.0.0.1", 0)
    try:
        got = await asyncio.to_thread(status.scaler_view, f"127.0.0.1:{sport}", "other", ["both"])
        [row] = got["pools"]
        assert row["active"] is None and row["error"].startswith("NOT_FOUND: ")
        assert "both error (NOT_FOUND" in status.fmt_scaler(got)
    finally:
        await scaler.stop()
    assert status.epp_scaler({"endpoints": []}, "http://127.0.0.1:1", ["both"]) is None
    assert status.fmt_scaler(None) == "scaler: not served by this EPP"
    assert status.stack_roles({"prefill": 0, "decode": 0}) == ["both"]
