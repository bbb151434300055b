"""Prefill/decode disaggregation, the workers' half (llm-d's wire, vLLM's names).

A decode worker that receives `x-prefiller-host-port` (set and signed by the
EPP) checks the signature (`decode.py`), sends the prefill worker the
request with `max_tokens: 1` and `kv_transfer_params.do_remote_decode`
(`params.py`), and parks the request in its engine while it pulls the held
blocks from the prefill worker (framed and checksummed with the kvstore codec:
`peer_wire.py`); the blocks enter its prefix cache and the request runs as
usual. Any failure: the store, else a local prefill. `runtime.py` wires it into
the server; `metrics.py` counts it (decode side: handoffs, fallbacks, phases;
prefill side: holds).

Two transports, one hold protocol (`peer_server.py` serves both):
- TCP (`peer_client.py`), between any two pods: the frames go from the cache
  rows to the socket (sendmsg) and into one receive buffer.
- Same host (`peer_shm.py`), preferred when the offer says `shm` and the prefill
  worker's abstract Unix socket is reachable (same network namespace, same uid):
  the prefill worker writes the held frames into a fresh memfd (pwritev from the
  cache rows), seals it against resizing before the descriptor is passed
  (SCM_RIGHTS) and against writes once the last frame is in; the decode worker
  maps it privately, verifies every frame as over TCP while later chunks are
  still being written, and the engine copies the blocks from the mapping.
  Why not map the prefill worker's whole KV cache instead (one copy fewer): a
  decode worker could then read every other request's KV; with a per-hold memfd
  it can read exactly what a valid hold offers, once. Where the abstract socket
  is not reachable (pods on one node, separate namespaces) TCP is used; every
  failure after a claim is a fallback counted by reason, as over TCP.
"""
