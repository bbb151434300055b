"""The SLO series on the EPP's Prometheus registry, computed at scrape time.

`kvyard:slo_attainment{class}`: the share of the last 512 observed SLO requests of a
class (`standard`, `sheddable`) that met both objectives (1 before any);
`kvyard:slo_ttft_violations_total{class}` and `kvyard:slo_requests_total{class}`:
their ratio is the TTFT-violation rate; `kvyard:slo_predictor_mape{kind}` and
`kvyard:slo_predictor_p90_coverage{kind}` (ttft, tpot) on held-out requests. Every
series is present from start (KEDA reads an absent series as 0).
"""
from __future__ import annotations

from .predictor import LatencyPredictor

CLASSES = ("standard", "sheddable")


class SloCollector:
    def __init__(self, predictor: LatencyPredictor) -> None:
        self._p = predictor

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self._p
        att = GaugeMetricFamily("kvyard:slo_attainment",
                                "Share of recent SLO requests that met their objectives",
                                labels=["class"])
        vio = CounterMetricFamily("kvyard:slo_ttft_violations",
                                  "SLO requests whose TTFT exceeded x-llm-d-slo-ttft-ms",
                                  labels=["class"])
        req = CounterMetricFamily("kvyard:slo_requests", "Observed requests with SLO headers",
                                  labels=["class"])
        got = p.attainment()
        for c in CLASSES:
            att.add_metric([c], got.get(c, 1.0))
            vio.add_metric([c], float(p.ttft_violations.get(c, 0)))
            req.add_metric([c], float(p.slo_requests.get(c, 0)))
        mape = GaugeMetricFamily("kvyard:slo_predictor_mape",
                                 "Latency predictor's mean absolute percentage error (held out)",
                                 labels=["kind"])
        cov = GaugeMetricFamily("kvyard:slo_predictor_p90_coverage",
                                "Share of held-out outcomes at or below the predicted p90",
                                labels=["kind"])
        for kind, e in (("ttft", p.ttft_err), ("tpot", p.tpot_err)):
            s = e.snapshot()
            mape.add_metric([kind], s["mape"] or 0.0)
            cov.add_metric([kind], s["p90_coverage"] or 0.0)
        yield from (att, vio, req, mape, cov)
