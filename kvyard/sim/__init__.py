"""`kvyard sim`: many simulated workers in one process, for routing at cluster scale.

Each simulated pod is a real HTTP server on its own port speaking the worker's protocol
(OpenAI completions and chat with SSE, vLLM's `/metrics`, `/health`, KV events on ZMQ),
with the real tokenizer and block hashes (kvyard.common), a block-level LRU prefix cache
of a set capacity and continuous batching; only the model is replaced by a latency model
(`latency.py`, profiles in `profiles.py`). `kvyard up --sim N` puts N of them behind the
real Envoy and EPP (kvyard.stack.sim_pool).

Modules: `profiles.py` (latency profiles and where their numbers come from), `latency.py`
(TTFT, ITL and P/D transfer time, jitter, `--time-scale`), `cache.py` (the KV block pool
and prefix cache), `engine.py` (the batching loop), `events.py` (KV events on ZMQ),
`server.py` (one pod's HTTP app), `pool.py` (N pods in one event loop), `config.py`
(flags), `calibrate.py` (`kvyard sim calibrate`), `cli.py`.
Boundaries: no torch, never kvyard.workers.
"""
