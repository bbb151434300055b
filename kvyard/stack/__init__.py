"""The local stack: `kvyard up/down/status`, the demo, and a model-free stand-in worker.

`spec` says what a stack is made of, `commands` the command lines its processes
run, `launch` starts them in dependency order (`readiness`: when each is ready;
`scaling`: the scale-to-zero part) and stops them, `state` is the record it
leaves in the run dir, `procs` does the process-group work, `endpoints_file` is
the EPP's endpoints file. `up`/`down`/`status` are the CLI, `supervise` restarts
and resizes, `standin` is the stand-in worker, `sim_pool` runs simulated pods (kvyard.sim,
`kvyard up --sim N`), `demo` is what `make demo` runs.
"""
