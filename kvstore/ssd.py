"""The node-local disk tier: one file per block under a directory that several
processes on the node may share.

Layout: `<root>/<namespace hex>/<2 hex of the hash>/<hash hex>.kvb`, each file
a header + payload (see codec). Writers write a private temp file (named by
pid and thread) and `os.replace` it over the final name, so a reader opens
either the old complete file or the new complete file, never a torn one; two
processes writing the same key leave one valid copy (last rename wins, both
are correct). fsync is optional: without it a power loss may leave a short
file, which the checksum catches on read.

Capacity is enforced per process on the files it knows: those found by a scan
(at start, and again every `rescan_s` on the write path, so other processes'
files enter the accounting) plus its own writes and hits. LRU order is by
access: reads bump the file's mtime (at most once a minute per key) so a
restart's scan recovers the order.
A full disk (ENOSPC) evicts a slice of the oldest files, retries once, and
counts an error; it never raises into the caller.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from kvyard.kvstore.codec import HEADER_BYTES, CorruptBlock, check_header, decode
from kvyard.kvstore.layout import KVLayout
from kvyard.kvstore.stats import TierStats

SUFFIX = ".kvb"
STALE_TMP_S = 600.0  # a temp file this old belongs to a writer that died
TOUCH_S = 60.0  # a file's mtime (LRU order across restarts) is bumped at most this often


class SsdTier:
    name = "ssd"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, *, fsync: bool = False,
                 rescan_s: float = 60.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = int(capacity_bytes)
        self.fsync = fsync
        self.rescan_s = rescan_s
        self.stats = TierStats()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self._lock = threading.Lock()
        self._dirs: set[str] = set()
        self._bumped: dict[bytes, float] = {}  # key -> monotonic time of its last mtime bump
        self._next_scan = 0.0
        self.rescan()

    # -- paths and index -------------------------------------------------
    def path(self, key: bytes) -> str:
        h = key[16:].hex()
        return os.path.join(self.root, key[:16].hex(), h[:2], h + SUFFIX)

    def _remember(self, key: bytes, size: int) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            self.stats.bytes += size - (old or 0)
            self._index[key] = size

    def _forget(self, key: bytes) -> None:
        self._bumped.pop(key, None)
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self.stats.bytes -= old

    def rescan(self) -> None:
        """Rebuild the index from the directory, oldest access first."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for ns in _scandir(self.root):
            for shard in _scandir(ns.path):
                for f in _scandir(shard.path):
                    try:
                        st = f.stat()
                    except OSError:
                        continue
                    if f.name.endswith(".tmp"):
                        if now - st.st_mtime > STALE_TMP_S:
                            _unlink(f.path)
                        continue
                    if not f.name.endswith(SUFFIX):
                        continue
                    try:
                        key = bytes.fromhex(ns.name) + bytes.fromhex(f.name[:-len(SUFFIX)])
                    except ValueError:
                        continue
                    if len(key) == 32:
                        found.append((st.st_mtime, key, st.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((k, s) for _, k, s in found)
            self.stats.bytes = sum(s for _, _, s in found)
        self._next_scan = time.monotonic() + self.rescan_s

    # -- reads -------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        """Asks the file system, not the index: another process may have written it."""
        try:
            size = os.stat(self.path(key)).st_size
        except OSError:
            self._forget(key)
            return False
        if key not in self._index:
            self._remember(key, size)
        return True

    def get(self, key: bytes, layout: KVLayout) -> tuple[memoryview, np.ndarray] | None:
        """(payload view, whole file buffer) or None; corrupt files are deleted."""
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buf = np.empty(size, dtype=np.uint8)  # unlike bytearray, not zero-filled first
                got = 0
                view = memoryview(buf)
                while got < size:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
        except FileNotFoundError:
            self._forget(key)
            with self._lock:
                self.stats.misses += 1
            return None
        except OSError:
            with self._lock:
                self.stats.errors += 1
                self.stats.misses += 1
            return None
        try:
            payload = decode(view[:got], key, layout)
        except CorruptBlock:
            _unlink(path)
            self._forget(key)
            with self._lock:
                self.stats.errors += 1
                self.stats.misses += 1
            return None
        self._touch(key, path, size)
        return payload, buf

    # -- writes ------------------------------------------------------------
    def read_into(self, key: bytes, layout: KVLayout, out: memoryview) -> bool:
        """Read the payload straight into `out` (one pass, no staging buffer), verified.

        On False, `out` may hold garbage: callers use only what a True filled."""
        path = self.path(key)
        hdr = bytearray(HEADER_BYTES)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(key)
            with self._lock:
                self.stats.misses += 1
            return False
        except OSError:
            with self._lock:
                self.stats.errors += 1
                self.stats.misses += 1
            return False
        try:
            size = os.fstat(fd).st_size
            got = os.preadv(fd, [hdr, out], 0) if size == HEADER_BYTES + layout.nbytes else -1
        except OSError:
            got = -1
        finally:
            os.close(fd)
        ok = got == size
        if ok:
            try:
                check_header(hdr, key, layout, out)
            except CorruptBlock:
                ok = False
        if not ok:
            _unlink(path)
            self._forget(key)
            with self._lock:
                self.stats.errors += 1
                self.stats.misses += 1
            return False
        self._touch(key, path, size)
        return True

    def _touch(self, key: bytes, path: str, size: int) -> None:
        """Count a hit and move the key to the LRU's young end. The file's mtime, the
        order a restart recovers, is bumped at most every TOUCH_S per key: a utime per
        read dirties an inode per block (a syscall and a journal update, a visible
        share of read throughput), and an order to the minute is all a restart needs."""
        now = time.monotonic()
        if now - self._bumped.get(key, -TOUCH_S) >= TOUCH_S:
            try:
                os.utime(path)
            except OSError:
                pass
            self._bumped[key] = now
        with self._lock:
            self.stats.hits += 1
            if key in self._index:
                self._index.move_to_end(key)
            else:
                self._index[key] = size
                self.stats.bytes += size

    def put(self, key: bytes, bufs: list) -> bool:
        """Write one block file from `bufs` (header and payload, or one framed buffer)."""
        bufs = [memoryview(b).cast("B") for b in bufs]
        size = sum(b.nbytes for b in bufs)
        if size > self.capacity:
            return False
        if time.monotonic() >= self._next_scan:  # other processes' files join the count
            self._next_scan = time.monotonic() + self.rescan_s  # one thread rescans
            self.rescan()
        self._reserve(key, size)
        path = self.path(key)
        d = os.path.dirname(path)
        if d not in self._dirs:
            os.makedirs(d, exist_ok=True)
            self._dirs.add(d)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        for attempt in range(2):
            try:
                self._write(tmp, bufs)
                os.replace(tmp, path)
                self._bumped[key] = time.monotonic()  # a new file: its mtime is now
                break
            except OSError as e:
                _unlink(tmp)
                if e.errno == errno.ENOENT and attempt == 0:  # directory removed under us
                    self._dirs.discard(d)
                    os.makedirs(d, exist_ok=True)
                    continue
                with self._lock:
                    self.stats.errors += 1
                if e.errno in (errno.ENOSPC, errno.EDQUOT) and attempt == 0:
                    self._evict(max(size, self.capacity // 20))
                    continue
                self._forget(key)
                return False
        else:
            self._forget(key)
            return False
        return True

    def _write(self, tmp: str, bufs: list[memoryview]) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            bufs = list(bufs)
            while bufs:
                n = os.writev(fd, bufs)
                while bufs and n >= bufs[0].nbytes:
                    n -= bufs[0].nbytes
                    bufs.pop(0)
                if bufs and n:
                    bufs[0] = bufs[0][n:]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _reserve(self, key: bytes, size: int) -> None:
        """Account for the block before writing it, evicting the LRU files it displaces,
        in one step under the lock, so concurrent writers never overshoot together."""
        victims: list[bytes] = []
        with self._lock:
            old = self._index.pop(key, None)
            self.stats.bytes += size - (old or 0)
            while self.stats.bytes > self.capacity and self._index:
                victim, vsize = self._index.popitem(last=False)
                self.stats.bytes -= vsize
                self.stats.evictions += 1
                victims.append(victim)
            self._index[key] = size
        for victim in victims:
            self._bumped.pop(victim, None)
            _unlink(self.path(victim))

    def _evict(self, nbytes: int) -> None:
        """Delete the least recently used files until `nbytes` are freed."""
        freed = 0
        while freed < nbytes:
            with self._lock:
                if not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self.stats.bytes -= size
                self.stats.evictions += 1
            self._bumped.pop(key, None)
            _unlink(self.path(key))
            freed += size

    def discard(self, key: bytes) -> None:
        _unlink(self.path(key))
        self._forget(key)


def _scandir(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
