"""SLO-aware routing: latency predictors trained online, output-length prediction,
SLO admission and the predictive scaling signal (docs/slo.md).

How the EPP sees a request's first token and end: the routing answer names each request
the latency scorer follows (`x-kvyard-flight`), and the gateway's second, observe-only
ext_proc filter (Envoy `observability_mode`: it sends, never waits) streams that
request's headers, response headers and response body to the EPP. The EPP timestamps
the first body chunk that carries generated text (TTFT) and the end of the body, reads
`usage.completion_tokens` when the body has it (else counts the text events): TPOT =
(end - first) / (tokens - 1), and the output length. Why: nothing is asked of the model
server (stock vLLM works), it is exact per request, and no token waits for the EPP.
Without the latency scorer and `observe_responses`, nothing of this runs.

Modules: `headers.py` (the SLO headers, the request facts in the cycle state),
`online.py` (relative-error recursive least squares and an online quantile), `models.py`
(a model per role pooled over its endpoints, an endpoint's own where it is better),
`features.py` (what a prediction reads off an endpoint), `outlen.py` (output length),
`predictor.py` (TTFT/TPOT models, requests in flight, held-out error), `trace.py` (the
optional per-request trace for offline fits), `observe.py` (one
response's timing; the observing streams paired with decisions), `admission.py` (SLO
admission), `metrics.py` (Prometheus), `wiring.py` (into the EPP).
"""
