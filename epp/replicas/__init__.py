"""Active-active EPP replicas: N EPPs behind one Envoy that decide alike.

Envoy balances ext_proc streams over the EPP cluster's hosts, so one burst of a new
prefix is split across replicas. Each replica already builds the same KV-event index
from the same events (every replica subscribes to every pod, with replay); what it
does not see is the other replicas' picks, which a lone EPP counts at once: the
speculative entries of the precise scorer, the approximate prefix index, and the
picks counted on the endpoint until its next scrape (`Endpoint.pending`). Those are
shared here:

* **Pub/sub** (`bus.py`). Each replica binds a ZMQ PUB (`--replica-port`, default
  9005) and a ROUTER for snapshots on the next port; it SUBscribes to every peer's
  PUB. A message is one batch of picks, flushed once per event-loop turn (no
  per-request thread or send): `[replica id, [[address, prompt-block hashes,
  {engine block size: own keys}, wall time], ...]]` (msgpack, `wire.py`). A replica
  drops its own messages, so a peer list that includes itself is harmless.
* **Applying a peer's pick** (`apply.py`) does what the local pick did in the
  scheduler's PreRequest hooks: the precise scorer's speculative entries (expiring
  `speculativeTTL` after the *original* pick, by the message's wall time) or its
  fallback index, the `prefix-cache` index, and `pending += 1` on the endpoint.
  The whole prompt, once the finisher has hashed it after the answer, follows as a
  `learned` message and is taught to the peers' PostResponse plugins as the
  finisher teaches the local ones (the precise scorer's speculative keys stay those
  known at the pick; the events confirm the rest within a prefill). A pick that
  reaches a replica twice (live and in a snapshot) is applied once.
* **Deterministic tie-breaking.** With replicas configured the director orders the
  candidates by address and seeds the picker's random tie-break from the prompt's
  first block hash (`stable_seed`), so two replicas in the same state pick the same
  endpoint, and ties between different prompts still spread over the pool (`--seed`
  then no longer matters: a per-process random stream would part the replicas).
* **Late start.** A replica asks its peers' ROUTERs for their recent picks (those of
  the last `snapshot_window_s`, at most `snapshot_max` of them) and applies them
  before readiness turns SERVING; with no answer within `catch_up_timeout_s` it
  serves anyway (a lone first replica has no one to ask). KV events catch up through
  the subscriber's own replay.
* **Peers.** `--peers host:port,...` (each a replica's PUB port) locally;
  in Kubernetes `--peers-dns NAME:PORT`, a headless Service selecting the EPP pods,
  re-resolved every few seconds (each A record is a replica). A real cluster needs
  that headless Service (`clusterIP: None`, `publishNotReadyAddresses: true` so a
  starting replica can be asked for nothing and still reach its peers), the pub
  and snapshot ports open between EPP pods, and a PodDisruptionBudget (the chart
  renders all three with `epp.replicas` > 1).

Envoy's side (kvyard/gateway/config.py): the ext_proc cluster lists every replica,
with gRPC health checks on the EPP's health port (service `readiness`) so new
streams go only to replicas that have caught up, and outlier detection on top.
"""
