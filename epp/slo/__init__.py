"""SLO-aware routing: latency predictors trained online, output-length prediction,
SLO admission and the predictive scaling signal (docs/slo.md).

How the EPP sees a request's first token and end: through ext_proc's response phases.
The latency scorer asks Envoy, per request, for the response headers and the streamed
response body (`mode_override` in the routing answer; the gateway allows it), so the EPP
timestamps the first body chunk that carries generated text (TTFT) and the last one
(end), reads `usage.completion_tokens` when the body has it (else counts the
generated-text events): TPOT = (end - first) / (tokens - 1), and the output length. Why this way:
it needs nothing from the model server (stock vLLM works), it is the EPP's own clock
(the one its decisions are made on), and it costs nothing for requests it does not
observe (`observeFraction`): without the latency scorer no response message ever
reaches the EPP. The cost per observed request is one ext_proc message per streamed
chunk; the bench measures it (docs/bench/slo.md).

Modules: `headers.py` (the SLO headers, the request facts in the cycle state),
`online.py` (recursive least squares and an online quantile), `features.py` (what a
prediction reads off an endpoint), `outlen.py` (output length), `predictor.py`
(per-endpoint TTFT/TPOT models, requests in flight, held-out error), `observe.py` (one
response's timing from the ext_proc messages), `admission.py` (SLO admission),
`metrics.py` (Prometheus).
"""
