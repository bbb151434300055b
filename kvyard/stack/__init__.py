"""The local stack: `kvyard up/down/status`, the demo, and a model-free stand-in worker.

`launch` starts and records processes (`procs` does the process-group work),
`up`/`down`/`status` are the CLI, `standin` is the stand-in worker, `demo`
is what `make demo` runs, `loadgen` is the benchmark's client.
"""
