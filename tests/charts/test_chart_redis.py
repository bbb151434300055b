"""charts/kvyard's Redis: bounded, authenticated, wired to the workers; its config and start
script run for real.
"""
from __future__ import annotations

import shutil
import time

import pytest
import yaml


# --- Redis: bounded, authenticated, wired to the workers ------------------------------------

def _redis_conf(ch, objs):
    conf = ch.one(objs, "ConfigMap", "kvyard-redis")["data"]["redis.conf"]
    return dict(line.split(" ", 1) for line in conf.splitlines() if line.strip())


def test_redis_is_bounded_with_kvyards_default(ch):
    from kvyard.kvstore.redis_conf import DEFAULT_MAX_MEMORY_BYTES, EVICTION_POLICY

    assert ch.chart().values["redis"]["maxMemoryBytes"] == DEFAULT_MAX_MEMORY_BYTES
    objs = ch.objects("everything")  # redis.enabled through the CPU preset
    conf = _redis_conf(ch, ch.objects("gpu"))
    assert conf["maxmemory"] == str(16 << 30) and conf["maxmemory-policy"] == EVICTION_POLICY
    default_on = ch.chart().render({"redis": {"enabled": True}}, name=ch.RELEASE,
                                   namespace=ch.NAMESPACE)
    cm = next(d for d in yaml.safe_load_all(default_on["kvyard/templates/redis.yaml"])
              if d and d["kind"] == "ConfigMap")
    conf = dict(line.split(" ", 1) for line in cm["data"]["redis.conf"].splitlines() if line)
    assert conf["maxmemory"] == str(DEFAULT_MAX_MEMORY_BYTES)
    assert conf["maxmemory-policy"] == "allkeys-lru"
    assert conf["save"] == '""' and conf["appendonly"] == "no"
    assert conf["include"] == "/run/redis-auth/auth.conf"
    # the container limit leaves room above maxmemory (allocator overhead, client buffers)
    dep = ch.one(objs, "Deployment", "kvyard-redis")
    limit = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert int(limit) == (256 << 20) * 3 // 2 + (64 << 20)


def test_redis_password_from_secret_never_on_a_command_line(ch):
    objs = ch.objects("cpu")
    secret = ch.one(objs, "Secret", "kvyard-redis")
    import base64
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) >= 32 and password.isalnum()
    for path, text in ch._render("cpu"):  # only the Secret has it, and only base64-encoded
        assert password not in text, path
    [c] = ch.one(objs, "Deployment", "kvyard-redis")["spec"]["template"]["spec"]["containers"]
    assert {"name": "REDISCLI_AUTH", "valueFrom": {"secretKeyRef": {
        "name": "kvyard-redis", "key": "password"}}} in c["env"]
    # the first InferenceService is pointed at it, with the Secret for KVYARD_REDIS_PASSWORD
    [svc] = ch.by_kind(objs, "InferenceService")
    assert svc["spec"]["kvstore"]["redis"] == {
        "url": "redis://kvyard-redis.llm.svc:6379",
        "secretRef": {"name": "kvyard-redis", "key": "password"}}
    # a given password or Secret is used instead of a generated one
    given = ch.chart().render({"redis": {"enabled": True, "auth": {"existingSecret": "mine",
                                                                 "existingSecretKey": "pw"}}},
                           name=ch.RELEASE, namespace=ch.NAMESPACE)
    docs = [d for d in yaml.safe_load_all(given["kvyard/templates/redis.yaml"]) if d]
    assert "Secret" not in [d["kind"] for d in docs]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["volumes"][1]["secret"] == {
        "secretName": "mine", "defaultMode": 0o440, "items": [{"key": "pw", "path": "password"}]}


def test_redis_start_script_writes_the_password_into_an_included_file(ch, tmp_path):
    """Run the container's start script with a stand-in redis-server: the included file holds
    the password quoted for redis.conf, even with quotes and backslashes in it."""
    [c] = ch.one(ch.objects("cpu"), "Deployment", "kvyard-redis")["spec"]["template"]["spec"][
        "containers"]
    assert c["command"] == ["sh", "-c"]
    script = c["args"][0].replace("/etc/redis-secret/password", str(tmp_path / "pw")) \
        .replace("/run/redis-auth/auth.conf", str(tmp_path / "auth.conf")) \
        .replace("exec redis-server", "exec echo")
    import subprocess
    (tmp_path / "pw").write_text('a"b\\c')
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "/etc/redis/redis.conf"
    assert (tmp_path / "auth.conf").read_text() == 'requirepass "a\\"b\\\\c"\n'
    assert (tmp_path / "auth.conf").stat().st_mode & 0o077 == 0


@pytest.mark.skipif(not shutil.which("redis-server"), reason="needs redis-server")
def test_rendered_redis_config_runs_in_a_real_redis_server(ch, tmp_path, free_port):
    """The chart's redis.conf and start script, run by a real redis-server (loopback, a free
    port): the password, with quotes, a backslash and a space in it, is required and works;
    the cap and the policy are the rendered ones; nothing is persisted."""
    import subprocess

    import redis

    objs = ch.objects("cpu")
    conf = ch.one(objs, "ConfigMap", "kvyard-redis")["data"]["redis.conf"]
    [c] = ch.one(objs, "Deployment", "kvyard-redis")["spec"]["template"]["spec"]["containers"]
    port = free_port()
    (tmp_path / "data").mkdir()
    conf = conf.replace("port 6379", f"port {port}").replace("bind * -::*", "bind 127.0.0.1") \
        .replace("dir /data", f"dir {tmp_path / 'data'}") \
        .replace("/run/redis-auth/auth.conf", str(tmp_path / "auth.conf"))
    (tmp_path / "redis.conf").write_text(conf)
    password = 'pa"ss\\ w0rd'
    (tmp_path / "pw").write_text(password)
    script = c["args"][0].replace("/etc/redis-secret/password", str(tmp_path / "pw")) \
        .replace("/run/redis-auth/auth.conf", str(tmp_path / "auth.conf")) \
        .replace("/etc/redis/redis.conf", str(tmp_path / "redis.conf"))
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        import socket

        deadline = time.monotonic() + 10
        while True:  # the port first: redis-py's own connect retries back off for seconds
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline
                time.sleep(0.02)
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        def client(pw):  # no retries: a refused AUTH is an answer, not a flake
            return redis.Redis(port=port, password=pw, socket_timeout=2,
                               retry=Retry(NoBackoff(), 0))

        authed = client(password)
        assert authed.ping()
        with pytest.raises(redis.AuthenticationError):
            client(None).ping()
        with pytest.raises(redis.AuthenticationError):
            client("wrong").ping()
        got = {k: authed.config_get(k)[k] for k in ("maxmemory", "maxmemory-policy", "save",
                                                    "appendonly")}
        assert got == {"maxmemory": str(256 << 20), "maxmemory-policy": "allkeys-lru",
                       "save": "", "appendonly": "no"}
    finally:
        proc.terminate()
        proc.wait(10)


def test_external_redis_goes_to_the_inference_service(ch):
    objs = ch.objects("external-redis")
    assert not [o for o in objs if "redis" in o["metadata"]["name"]]
    [svc] = ch.by_kind(objs, "InferenceService")
    assert svc["spec"]["kvstore"]["redis"] == {
        "url": "redis://cache.infra:6379", "secretRef": {"name": "cache-auth", "key": "pw"}}
