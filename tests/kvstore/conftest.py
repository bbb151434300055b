"""Fixtures for the kvstore tests: a small layout, namespaces, a real redis-server."""
from __future__ import annotations

import os

import pytest

from kvyard.kvstore import KVLayout, Namespace
from kvyard.kvstore.redis_server import RedisServer


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout("bfloat16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


@pytest.fixture
def ns(layout) -> Namespace:
    return Namespace("model-a@0123456789abcdef", layout)


@pytest.fixture
def make_blocks(layout):
    def make(n: int) -> list[bytes]:
        return [os.urandom(layout.nbytes) for _ in range(n)]
    return make


@pytest.fixture
def redis_server():
    with RedisServer(password="s3cret-test") as rs:
        yield rs


@pytest.fixture
def redis_cluster():
    """A real 3-master Redis Cluster (password, masterauth, no replicas, surviving
    masters keep serving when one dies), torn down after the test."""
    from kvyard.kvstore.redis_server import RedisClusterServers

    with RedisClusterServers(masters=3, password="cluster-s3cret") as rc:
        yield rc
