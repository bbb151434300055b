"""kvyard's Endpoint Picker (EPP): Envoy asks it, per request, which worker to use.

A request's path: `server` (the ext_proc protocol) → `director.Director.handle`:
parse (`request`, `prompt`) → `admission` (shedding, or `flow.controller`'s
queues and waiting room) → `scheduling` (profiles of filters, scorers and a
picker, then the pre-request hooks) → the decision; after the answer,
`finisher` teaches the plugins the whole prompt.

Layout, by role (one job per module):

* `server`, `responses` — ext_proc; `director`, `admission`, `finisher`,
  `request`, `prompt`, `saturation` — the request's path.
* `scheduling/` — the scheduler, its plugins (`hooks` are their types,
  `registry` their config names) and its YAML config (`scheduler.example.yaml`
  documents every plugin).
* `flow/` — flow control (the saturation queue and the waiting room) and the
  demand it reports.
* `pool/` — the live endpoints: discovery, scraping.
* `kvevents/` — the workers' KV events: subscriptions, gap repair, the block
  index the `precise-prefix-cache` scorer reads.
* `scaler/` — KEDA's external scaler.
* `health`, `observability`, `xds` — gRPC health, Prometheus + /debug, EDS.
* `app` wires it all; `cli` is `kvyard epp`.

docs/ARCHITECTURE.md's EPP section says how to add a plugin and where the next
pieces (SLO-aware admission, LoRA affinity, shared picks across replicas) plug
in.
"""
