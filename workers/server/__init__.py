"""The worker's OpenAI-compatible HTTP server (`kvyard worker`).

`cli` (flags, engine construction) -> `serve` (signals, drain) -> `app` (routes,
endpoint header) -> `generate` (completions/chat, streaming, disconnects), with
`protocol` (request validation), `responses` (OpenAI shapes), `errors`
(OpenAI error JSON) and `metrics` (vLLM names). `testing` starts a real worker
process for integration tests.
"""
