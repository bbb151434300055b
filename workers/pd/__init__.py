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

By default the pull is streamed (`peer_stream.py`): opened beside the prefill
leg, under a hold name the decode worker chose, it receives each chunk's blocks
as the prefill worker's engine computes them.

Two transports, one hold protocol (`peer_server.py` serves both):
- TCP (`peer_client.py`), between any two pods: the frames go from the cache
  rows to the socket (sendmsg) and into one receive buffer.
- Same host (`peer_shm.py`, `shm_pool.py`), preferred when the offer says `shm`
  and the prefill worker's abstract Unix socket is reachable (same network
  namespace, same uid): the decode worker passes a memfd of its own with the
  request (SCM_RIGHTS); the prefill worker writes the held frames into it with
  pwritev straight from the cache rows, without mapping it, and reports each
  chunk; the decode worker verifies chunk k while chunk k+1 is written, and the
  engine copies the blocks from that buffer into its cache.
  Why not map the prefill worker's KV cache instead (one copy fewer): a decode
  worker could then read every other request's KV; this way it sees exactly what
  a valid hold offers. Why the decode worker's buffer and not a fresh memfd from
  the prefill worker: a fresh one pays a page allocation per 4 KiB (measured no
  faster than TCP), the decode worker's are reused, per prefill peer (a peer that
  kept a descriptor sees only its own frames), sealed against resizing (a peer
  cannot truncate one under the mapping) and never reused after a failed
  transfer. Where the socket is not reachable (pods on one node, separate
  namespaces) TCP is used; every failure after a claim is a fallback counted by
  reason, as over TCP.
"""
