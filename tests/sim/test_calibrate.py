"""`kvyard sim calibrate` end to end against a simulated pod (`--url`), so it runs in
seconds: it measures, fits and writes a profile the simulator loads back."""
from __future__ import annotations

import argparse
import asyncio

from kvyard.sim import calibrate
from kvyard.sim.profiles import load_profile


async def test_calibrate_writes_a_loadable_profile(start_pods, tmp_path) -> None:
    out = tmp_path / "p.json"
    p = argparse.ArgumentParser()
    calibrate.add_arguments(p)
    async with start_pods(1) as g:
        args = p.parse_args(["--url", f"http://{g.pods[0].address}", "--prompt-lens", "16,64",
                             "--repeats", "1", "--concurrency", "1,2", "--decode-tokens", "4",
                             "--name", "measured", "--out", str(out)])
        rc = await asyncio.to_thread(calibrate.run, args)  # its own loop; the pod runs in ours
    assert rc == 0
    prof = load_profile(str(out))
    assert prof.name == "measured" and "kvyard sim calibrate" in prof.source
    assert prof.inter_token_latency > 0
