"""Prefill/decode disaggregation, the workers' half (llm-d's wire, vLLM's names).

A decode worker that receives `x-prefiller-host-port` (set and signed by the
EPP) checks the signature (`decode.py`), sends the prefill worker the
request with `max_tokens: 1` and `kv_transfer_params.do_remote_decode`
(`params.py`), and parks the request in its engine while it pulls the held
blocks from the prefill worker's peer endpoint (`peer_server.py`,
`peer_client.py`, framed and checksummed with the kvstore codec:
`peer_wire.py`); the blocks enter its prefix cache and the request runs
as usual. Any failure: the store, else a local prefill. `runtime.py` wires
it into the server; `metrics.py` counts it.
"""
