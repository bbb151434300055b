"""kvyard's Endpoint Picker (EPP): Envoy asks it, per request, which worker to use.

Layout (one job per module):

* `server` — the ext_proc stream handler; `responses` builds its messages.
* `request` — parses and validates the OpenAI body; `prompt` turns it into
  chained block hashes (tokenize once, with a chunk cache).
* `scheduler` — filters → weighted scorers → picker, built from YAML;
  `plugins` holds the filters and scorers, `prefix_index` the per-endpoint
  LRU of block hashes, `saturation` the shedding rule.
* `endpoints` — the live pool; `discovery_file` / `discovery_k8s` feed it,
  `scraper` keeps its metrics fresh (`metrics_parse` reads vLLM text).
* `health`, `observability` — gRPC health and Prometheus + /debug/endpoints.
* `app` wires it all; `cli` is `kvyard epp`; `bench_api` times decisions.

Extension points, deliberately not implemented yet:

* Decode-first P/D profile: a second scheduling profile run after the decode
  pick, over `role in (prefill, both)` endpoints, whose result would set
  `x-prefiller-host-port` when the decode pod's uncached tokens (total blocks
  minus its prefix match) exceed a threshold. `Decision` already carries the
  matched block count that this needs, and `responses.routing_response` takes
  an optional prefiller address.
* Precise prefix scorer: a scorer with the same interface as
  `plugins.PrefixCacheScorer` whose index is fed by vLLM KV events (ZMQ,
  protocols §4) instead of by our own routing decisions. Because both use
  `kvyard.common.hashing.block_hashes` over real token ids, the request side
  (`prompt.PromptHasher`) is already shared.
* Waiting room for pools scaled to zero: today an empty candidate set is an
  immediate 503. A flow-control stage between `request` parsing and
  `scheduler.schedule` could park the stream (ext_proc lets us answer later)
  until an endpoint appears or a TTL expires.
"""
