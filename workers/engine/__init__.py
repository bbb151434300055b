"""kvyard's inference engine (nano-vllm's shape, vLLM's names).

- `api` / `config`: the public contract (SamplingParams, RequestOutput, EngineStats, KVConnector, EngineConfig).
- `async_engine.AsyncLLMEngine`: what the server uses; the step loop in its own thread.
- `llm.LLM`: offline batch generation for tests and benchmarks.
- `llm_engine.LLMEngine`: one synchronous `step()` = schedule, run, sample, postprocess.
- `scheduler`: continuous batching, chunked prefill, FCFS admission, preemption by recompute;
  `postprocess` turns a step's tokens into outputs.
- `block_manager`: paged blocks, ref counts, prefix cache (LRU), KV events.
- `model_runner`: KV cache tensors, AttentionMetadata, the model call.
- `sampler` / `stopping`: next-token choice; stop tokens, stop strings, lengths.
- `guided`: guided decoding (JSON, JSON Schema, regex, choice) behind one `Constraint`.
- `handoff`: P/D, KV blocks to and from other workers (holds, remote loads, block reads).
- `sequence`: one request's internal state.

Importing this package loads nothing heavy; import the module you need.
"""
