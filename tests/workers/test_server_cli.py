"""`kvyard worker` flags (vLLM names, size units, defaults) and graceful SIGTERM."""
from __future__ import annotations

import argparse
import json
import signal
import threading
import urllib.request
from pathlib import Path

import pytest

from kvyard.cli import build_parser
from kvyard.workers.server.cli import advertise_address, engine_config, parse_size
from kvyard.workers.server.testing import start_worker


def parse(*argv: str) -> argparse.Namespace:
    full = ["worker", *argv]
    return build_parser(full).parse_args(full)


@pytest.mark.parametrize("text,value", [
    ("4096", 4096), ("1GiB", 1 << 30), ("512MiB", 512 << 20), ("512Mi", 512 << 20),
    ("2G", 2 * 10**9), ("2GB", 2 * 10**9), ("64KiB", 64 << 10), ("1.5Gi", 3 << 29),
    ("32k", 32000),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1XB", "-1G", "0", "0.5"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_flags_map_onto_the_engine_config() -> None:
    args = parse("--model", "demo", "--dtype", "bfloat16", "--max-model-len", "2k",
                 "--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                 "--kv-cache-memory-bytes", "256MiB", "--no-enable-prefix-caching",
                 "--seed", "3", "--role", "decode", "--served-model-name", "a", "b")
    cfg = engine_config(args)
    assert (cfg.model, cfg.dtype, cfg.max_model_len, cfg.block_size) == ("demo", "bfloat16",
                                                                         2000, 32)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (8, 512)
    assert cfg.kv_cache_memory_bytes == 256 << 20 and cfg.enable_prefix_caching is False
    assert (cfg.seed, cfg.role, cfg.served_model_name) == (3, "decode", "a")
    assert args.served_model_name == ["a", "b"]
    defaults = engine_config(parse())
    assert defaults.enable_prefix_caching is True and defaults.role == "both"
    with pytest.raises(SystemExit):
        parse("--role", "sideways")


def test_advertise_address_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_IP", raising=False)
    assert advertise_address(parse("--port", "8123")) == "127.0.0.1:8123"
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    assert advertise_address(parse("--port", "8123")) == "10.0.0.7:8123"
    assert advertise_address(parse("--advertise-address", "w0:9")) == "w0:9"


def test_sigterm_drains_in_flight_requests(tmp_path: Path, demo_gguf: Path, wait_until) -> None:
    assert demo_gguf.is_file()
    w = start_worker(["--model", "demo", "--dtype", "float32", "--max-model-len", "256",
                      "--kv-cache-memory-bytes", "16MiB", "--num-threads", "1"],
                     tmp_path / "worker.log")
    result: dict[str, object] = {}

    def call() -> None:
        body = json.dumps({"prompt": "Hello", "max_tokens": 24, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(w.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                result["status"], result["body"] = r.status, json.loads(r.read())
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    t = threading.Thread(target=call)
    try:
        t.start()

        def running() -> bool:
            with urllib.request.urlopen(w.base_url + "/metrics", timeout=10) as r:
                return any(line.startswith("vllm:num_requests_running{") and
                           not line.endswith(" 0.0") for line in r.read().decode().splitlines())

        wait_until(running, timeout=60, what="the request to start")
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(90) == 0, w.log_tail()
        t.join(30)
        assert result.get("status") == 200, result
        assert result["body"]["usage"]["completion_tokens"] == 24
        assert "stopped" in w.log_tail()
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait(10)
