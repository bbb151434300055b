"""Static endpoint list from a YAML file, reloaded when it changes.

    endpoints:                 # or a bare list
      - {address: 10.0.0.5:8000, role: decode}
      - 10.0.0.6:8000          # role both

The file is re-read every `interval` and compared by content, which is
cheaper than it sounds for a few dozen lines and, unlike mtime, never misses
two writes within one timestamp tick. A broken or missing file keeps the last
good list (an editor's half-written save must not empty the pool).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import yaml

from .endpoints import EndpointPool, EndpointSpec, parse_spec

log = logging.getLogger("kvyard.epp.discovery")


def parse_endpoints_yaml(text: str) -> list[EndpointSpec]:
    data = yaml.safe_load(text)
    if isinstance(data, dict):
        data = data.get("endpoints")
    if data is None:
        return []
    if not isinstance(data, list):
        raise ValueError("endpoints file: want a list or {endpoints: [...]}")
    return [parse_spec(e) for e in data]


@dataclass(slots=True)
class FileDiscovery:
    path: Path
    pool: EndpointPool
    interval: float = 0.25
    source: str = "file"
    _last: bytes | None = None
    loads: int = 0

    def poll(self) -> bool:
        """Reloads if the content changed; True when the pool was updated."""
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            if self._last is not None:
                log.warning("endpoints file %s unreadable, keeping last list: %s", self.path, e)
            return False
        if raw == self._last:
            return False
        try:
            specs = parse_endpoints_yaml(raw.decode("utf-8"))
        except (ValueError, yaml.YAMLError, UnicodeDecodeError) as e:
            log.error("endpoints file %s invalid, keeping last list: %s", self.path, e)
            self._last = raw
            return False
        self._last = raw
        self.pool.set_source(self.source, specs)
        self.loads += 1
        log.info("endpoints file %s: %d endpoints", self.path, len(specs))
        return True

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(self.interval)  # the poll period, not a sync point
