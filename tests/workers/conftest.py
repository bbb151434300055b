"""A real worker on the demo model for the server's API test modules (one per module)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import openai
import pytest

from kvyard.workers.server.testing import WorkerProcess, start_worker


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, demo_gguf: Path) -> Iterator[WorkerProcess]:
    assert demo_gguf.is_file()
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    env = {k: v for k, v in os.environ.items() if k != "POD_IP"}
    w = start_worker(["--model", "demo", "--dtype", "float32", "--max-model-len", "1024",
                      "--kv-cache-memory-bytes", "64MiB", "--num-threads", "1"], log, env=env)
    yield w
    assert w.stop() == 0, f"worker did not shut down cleanly:\n{w.log_tail()}"


@pytest.fixture(scope="module")
def client(worker: WorkerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)
