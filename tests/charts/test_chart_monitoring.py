"""charts/kvyard's PDBs and PodMonitors, and the Grafana dashboard: only metric names and
labels kvyard exports, PromQL Prometheus parses.
"""
from __future__ import annotations

import functools
import json
import re
import shutil

import pytest
import yaml


# --- PDBs and monitoring ---------------------------------------------------------------------

def test_pdbs_cover_each_component_of_each_listed_service(ch):
    objs = ch.objects("everything")
    pdbs = ch.by_kind(objs, "PodDisruptionBudget")
    covered = {(p["spec"]["selector"]["matchLabels"]["kvyard.io/service"],
                p["spec"]["selector"]["matchLabels"]["kvyard.io/component"]) for p in pdbs}
    assert covered == {(s, c) for s in ("demo", "other") for c in ("gateway", "epp", "worker")}
    for p in pdbs:
        gateway = p["spec"]["selector"]["matchLabels"]["kvyard.io/component"] == "gateway"
        assert p["spec"]["minAvailable" if gateway else "maxUnavailable"] == 1
        assert p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/managed-by"] == \
            "kvyard-operator"
    assert not ch.by_kind(ch.objects("default"), "PodDisruptionBudget")


def test_pod_monitors_scrape_workers_and_epps(ch):
    mons = ch.by_kind(ch.objects("everything"), "PodMonitor")
    got = {m["spec"]["selector"]["matchLabels"]["kvyard.io/component"]:
           m["spec"]["podMetricsEndpoints"][0]["targetPort"] for m in mons}
    assert got == {"worker": 8000, "epp": 9090}
    assert all(m["metadata"]["labels"]["release"] == "prom" for m in mons)
    assert not ch.by_kind(ch.objects("cpu"), "PodMonitor")


# --- the dashboard's metric names are ones kvyard exports ------------------------------------

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                 "or", "unless", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names (in `{...}` or `by (...)`) or Grafana variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # strings
    e = re.sub(r"\{[^}]*\}", "", e)                        # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                       # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\$\{?\w+\}?", "", e)                      # $__rate_interval, ${datasource}
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue  # a function or an aggregation
        if re.fullmatch(r"[0-9.e+-]+", word):
            continue
        names.add(word)
    return names


def _dashboard_exprs(dash: dict) -> list[str]:
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "definition") and isinstance(v, str):
                    exprs.append(v)
                elif k == "query" and isinstance(v, str) and node.get("type") == "query":
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(dash)
    for e in list(exprs):  # label_values(metric, label): its metric only
        exprs += [m.group(1) for m in re.finditer(r"label_values\(\s*([^,)]+)", e)]
    return [re.sub(r"label_values\([^)]*\)", "", e) for e in exprs]


def _exposition_texts() -> list[str]:
    """Every sample kvyard's components expose, from their own collectors rendered in the
    Prometheus text format (so histograms' _bucket/_sum/_count and counters' _total are the
    real ones): the worker (vllm:*), its kvstore and P/D metrics (kvyard:*), the EPP."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvyard.epp.observability import EppMetrics
    from kvyard.kvstore.metrics import KVStoreCollector
    from kvyard.workers.engine.api import EngineStats
    from kvyard.workers.server.metrics import ServerMetrics

    texts = []
    stats = EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, num_blocks=10,
                        block_size=16, prefix_queries_tokens=1, prefix_hits_tokens=1,
                        num_preemptions=0, prompt_tokens_total=1, generation_tokens_total=1)
    sm = ServerMetrics(lambda: stats, "m")
    clock = sm.clock()
    clock.on_tokens(2)
    clock.finish("stop")

    class _Tier:
        available = True

    class _Store:  # the shape KVStoreCollector reads
        tiers = {"dram": _Tier(), "redis": _Tier()}
        dropped_writes = 0

        def stats(self):
            return {t: {"hits": 0, "misses": 0, "evictions": 0, "errors": 0, "bytes": 0}
                    for t in self.tiers}

    sm.register_extra(KVStoreCollector(lambda: _Store()))
    try:
        from kvyard.workers.pd.metrics import HoldCollector, PDMetrics, worker_info
        worker_info(sm.registry, "decode")
        PDMetrics(sm.registry, sm.slow_registry).seconds.labels(path="peer").observe(0.1)
        sm.register_extra(HoldCollector(lambda: (3, {"pulled": 1})))  # the prefill side's
        from kvyard.workers.server.kv_events import KVEventMetrics
        KVEventMetrics(sm.registry)                      # with --kv-events-config
    except ImportError:
        pass
    texts.append(sm.render().decode())
    epp = EppMetrics()
    epp.latency.observe(0.001)
    epp.prefix_ratio.observe(0.5)
    epp.error("x")
    epp.picks.labels("a").inc()
    epp.endpoints.labels("known").set(1)
    texts.append(generate_latest(epp.registry).decode())
    return texts


def exported_metric_names() -> set[str]:
    return set(exported_metric_labels())


@functools.cache
def exported_metric_labels() -> dict[str, frozenset[str]]:
    """sample name -> the label names its samples carry."""
    out: dict[str, set[str]] = {}
    for text in _exposition_texts():
        for line in text.splitlines():
            if line and not line.startswith("#"):
                m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{([^}]*)\})?", line)
                labels = set(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(3) or ""))
                out.setdefault(m.group(1), set()).update(labels)
    return {k: frozenset(v) for k, v in out.items()}


def test_promql_metric_name_extraction():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, pod) (rate(vllm:e2e_request_latency_seconds_bucket'
        '{namespace=~"$namespace", le!="x"}[$__rate_interval]))) / on (pod) group_left '
        'max(kvyard:kvstore_bytes{tier="dram"}) > 0') == {
            "vllm:e2e_request_latency_seconds_bucket", "kvyard:kvstore_bytes"}


def test_dashboard_uses_only_metrics_kvyard_exports(ch):
    rendered = ch.one(ch.objects("default"), "ConfigMap", "kvyard-dashboard")
    assert rendered["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(rendered["data"]["kvyard.json"])
    assert dash == json.loads((ch.CHART / "dashboards" / "kvyard.json").read_text())
    used = set()
    for expr in _dashboard_exprs(dash):
        used |= promql_metric_names(expr)
    exported = exported_metric_names()
    assert len(used) >= 25, used
    assert used <= exported, f"not exported by any kvyard component: {sorted(used - exported)}"
    # every family kvyard exports shows up on the dashboard somewhere (no dead corners)
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in exported}
    shown = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    assert families - shown == set(), sorted(families - shown)


# labels Prometheus adds to every scraped series (PodMonitor / kubernetes_sd relabelling)
_TARGET_LABELS = {"namespace", "pod", "instance", "job", "container"}


def promql_label_names(expr: str) -> set[str]:
    """Label names an expression groups by or matches on."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels = set()
    for m in re.finditer(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", e):
        labels |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    for m in re.finditer(r"\{([^}]*)\}", e):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(1)))
    return labels


def test_dashboard_groups_and_matches_only_labels_the_metrics_carry(ch):
    """An empty panel from a misspelt label is as broken as one from a misspelt metric."""
    dash = json.loads((ch.CHART / "dashboards" / "kvyard.json").read_text())
    labels = exported_metric_labels()
    for expr in _dashboard_exprs(dash):
        names = promql_metric_names(expr)
        if not names:
            continue
        have = set().union(*(labels[n] for n in names)) | _TARGET_LABELS
        missing = promql_label_names(expr) - have
        assert not missing, f"{expr}: no metric in it has the labels {sorted(missing)}"
    assert promql_label_names('sum by (le, pod) (rate(x{tier="redis", a=~"b"}[5m]))') == \
        {"le", "pod", "tier", "a"}


@pytest.mark.skipif(not shutil.which("promtool"), reason="needs promtool (Debian: prometheus)")
def test_dashboard_promql_parses_with_prometheus(ch, tmp_path):
    """Prometheus's own parser on every expression (Grafana's variables filled in), through
    `promtool check rules` with each expression as a recording rule."""
    import subprocess

    dash = json.loads((ch.CHART / "dashboards" / "kvyard.json").read_text())
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(dash)
    assert len(exprs) >= 30
    subst = lambda e: e.replace("$__rate_interval", "5m").replace("$namespace", ".*")  # noqa: E731
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"kvyard_dashboard_check_{i}", "expr": subst(e)} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(exprs)} rules found" in out.stdout + out.stderr
