"""SSD tier: sharing between processes, corruption, capacity, a full disk, restarts."""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import uuid

import pytest

from kvyard.kvstore import KVLayout, KVStore, Namespace
from kvyard.kvstore.codec import HEADER_BYTES, encode_header
from kvyard.kvstore.ssd import SsdTier

FILE = HEADER_BYTES


def _writer(root: str, model: str, layout_fields: dict, fill: int, n: int, go) -> None:
    layout = KVLayout(**layout_fields)
    ns = Namespace(model, layout)
    ssd = SsdTier(root, 1 << 30)
    payload = bytes([fill]) * layout.nbytes
    key = ns.key(42)
    header = encode_header(key, layout, payload)
    go.wait(30)
    for _ in range(n):
        assert ssd.put(key, [header, payload])


def test_two_processes_writing_one_key_leave_one_valid_copy(ns, layout, tmp_path):
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    fields = dict(dtype=layout.dtype, block_size=layout.block_size, num_layers=layout.num_layers,
                  num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), ns.model, fields, fill, 300, go))
             for fill in (0xAA, 0x55)]
    for p in procs:
        p.start()
    go.set()
    reader = SsdTier(tmp_path, 1 << 30)
    seen = 0
    while any(p.is_alive() for p in procs):  # readers never see a torn file
        got = reader.get(ns.key(42), layout)
        if got is not None:
            seen += 1
            assert bytes(got[0]) in (b"\xaa" * layout.nbytes, b"\x55" * layout.nbytes)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = reader.get(ns.key(42), layout)
    assert got is not None and bytes(got[0]) in (b"\xaa" * layout.nbytes, b"\x55" * layout.nbytes)
    assert reader.stats.errors == 0
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) == 1 and files[0].endswith(".kvb"), files  # no temp files left behind


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_corrupt_file_is_deleted_counted_and_never_returned(ns, layout, make_blocks, tmp_path,
                                                            damage):
    ssd = SsdTier(tmp_path, 1 << 20)
    st = KVStore(ns, ssd=ssd)
    st.put([1, 2], make_blocks(2))
    assert st.flush()
    path = ssd.path(ns.key(2))
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[FILE + 100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    open(path, "wb").write(data)
    got = st.get([1, 2])
    assert got[0] is not None and got[1] is None
    assert not os.path.exists(path)
    s = st.stats()["ssd"]
    assert s["errors"] == 1 and s["misses"] == 1 and s["hits"] == 1
    assert st.lookup([1, 2]) == (1, ["ssd"])  # the caller recomputes block 2
    st.close()


def test_capacity_evicts_least_recently_used(ns, layout, make_blocks, tmp_path):
    size = layout.nbytes + HEADER_BYTES
    ssd = SsdTier(tmp_path, 3 * size)
    st = KVStore(ns, ssd=ssd)
    blocks = make_blocks(5)
    st.put([0, 1, 2], blocks[:3])
    assert st.flush()
    assert st.get([0])[0] is not None  # 0 becomes most recent; 1 then 2 are the LRU
    st.put([3, 4], blocks[3:])
    assert st.flush()
    present = [i for i in range(5) if ssd.contains(ns.key(i))]
    assert present == [0, 3, 4]
    assert ssd.stats.bytes == 3 * size
    assert ssd.stats.evictions == 2
    assert sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path)
               for f in fs) <= 3 * size
    st.close()


def test_restart_rescans_directory_in_access_order(ns, layout, make_blocks, tmp_path):
    size = layout.nbytes + HEADER_BYTES
    st = KVStore(ns, ssd=SsdTier(tmp_path, 10 * size))
    blocks = make_blocks(3)
    st.put([0, 1, 2], blocks)
    assert st.flush()
    st.close()
    for i, t in enumerate((300, 100, 200)):  # access times: 1 oldest, then 2, then 0
        p = SsdTier.path(st.ssd, ns.key(i))
        os.utime(p, (t, t))
    again = SsdTier(tmp_path, 10 * size)
    assert again.stats.bytes == 3 * size
    assert list(again._index) == [ns.key(1), ns.key(2), ns.key(0)]
    st2 = KVStore(ns, ssd=again)
    assert [bytes(b) for b in st2.get([0, 1, 2])] == blocks
    st2.close()


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 1 MiB tmpfs, so the disk really fills up (needs mount rights)."""
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        shutil.rmtree(mnt, ignore_errors=True)


def test_full_disk_evicts_counts_and_never_raises(tmp_path, tiny_fs):
    layout = KVLayout("float16", 16, 4, 2, 64)  # 32 KiB blocks; the disk holds about 31
    ns = Namespace("m@full", layout)
    ssd = SsdTier(tiny_fs, 100 << 20)  # the configured capacity lies: the disk is smaller
    st = KVStore(ns, ssd=ssd)
    blocks = [bytes([i]) * layout.nbytes for i in range(60)]
    for i in range(60):
        st.put([i], [blocks[i]])
        assert st.flush()
    assert ssd.stats.errors >= 1 and ssd.stats.evictions >= 1
    assert ssd.contains(ns.key(59))  # recent writes still land
    got = st.get([59])[0]
    assert got is not None and bytes(got) == blocks[59]
    st.close()


def test_reads_bump_mtime_at_most_once_per_touch_interval(ns, layout, make_blocks, tmp_path):
    """The LRU order a restart recovers comes from mtimes; a read bumps its file's mtime,
    but not again within TOUCH_S (a utime per read cost a syscall and a journal update)."""
    st = KVStore(ns, ssd=SsdTier(tmp_path, 1 << 20))
    st.put([7], make_blocks(1))
    assert st.flush()
    st.close()
    p = SsdTier.path(st.ssd, ns.key(7))
    os.utime(p, (100, 100))
    again = KVStore(ns, ssd=SsdTier(tmp_path, 1 << 20))  # a restart: nothing bumped yet
    assert again.get([7])[0] is not None
    assert os.stat(p).st_mtime > 100  # first read: bumped
    os.utime(p, (100, 100))
    assert again.get([7])[0] is not None
    assert os.stat(p).st_mtime == 100  # within TOUCH_S: left alone
    again.close()
