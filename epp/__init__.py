"""kvyard's Endpoint Picker (EPP): Envoy asks it, per request, which worker to use.

Layout (one job per module):

* `server` — the ext_proc stream handler; `responses` builds its messages.
* `request` — parses and validates the OpenAI body; `prompt` turns it into
  chained block hashes (tokenize once, with a chunk cache).
* `router` — the director: a request's lifecycle (admission → scheduling →
  headers → post-response teaching); `saturation` is today's admission rule.
* `scheduler` — the profile handler and its profiles plus pre-request hooks,
  built from YAML (`scheduler.example.yaml` documents every plugin);
  `profile` holds profiles, pickers and profile handlers, `plugins` the
  filters and scorers, `plugin_config` their typed, validated parameters,
  `cycle` the per-request state plugins share, `prefix_index` the
  per-endpoint LRU of block hashes.
* `endpoints` — the live pool; `discovery_file` / `discovery_k8s` feed it,
  `scraper` keeps its metrics fresh (`metrics_parse` reads vLLM text).
* `health`, `observability` — gRPC health and Prometheus + /debug/endpoints.
* `app` wires it all; `cli` is `kvyard epp`; `bench_api` times decisions.

Extension point, deliberately not implemented yet:

* Precise prefix scorer: a scorer with the same interface as
  `plugins.PrefixCacheScorer` whose index is fed by vLLM KV events (ZMQ,
  protocols §4) instead of by our own routing decisions. Because both use
  `kvyard.common.hashing.block_hashes` over real token ids, the request side
  (`prompt.PromptHasher`) is already shared.
"""
