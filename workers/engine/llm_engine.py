"""The synchronous engine: one `step()` = schedule, run the model, sample, postprocess.

Single-threaded on purpose: every structure it touches (sequences, block
tables, the prefix cache) is owned by the thread calling `step()`, so none of
them needs a lock. `AsyncLLMEngine` drives it from its own thread. The one
other thread is the KV loader's (kv_loads.py): it fills the cache rows of
blocks a parked request owns and posts the job back; a driver that installs
`set_kv_load_waker` hears when, one that does not has `step()` wait for it.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence as Seq

import torch

from kvyard.common.models import resolve_model
from kvyard.workers.attention.kv_quant import resolve_kv_format

from kvyard.workers.lora.manager import build_manager

from .api import EngineStats, RemoteKV, RequestOutput, SamplingParams
from .block_manager import BlockManager, KVEvent
from .config import EngineConfig
from .guided.vocab import GuidedVocab, wants_guidance
from .handoff import Handoff
from .kv_loads import KVLoader
from .model_runner import PREFILL_GRAPH_MAX_TOKENS, ModelRunner, kv_cache_bytes, num_blocks_for, resolve_device, resolve_dtype
from .sampler import Sampler, make_generator
from .scheduler import Scheduler
from .sequence import Sequence, output_of
from .spec import build_speculator, spec_tokens

log = logging.getLogger(__name__)
# A step this much slower than the recent ones (and at least STALL_MIN_S) is logged with what it
# ran: a compile, an allocation or a host stall shows up beside the step's composition.
STALL_RATIO, STALL_MIN_S = 8.0, 0.25


MAX_LOGPROBS = 20  # vLLM's default --max-logprobs and OpenAI's top_logprobs limit


class LLMEngine:
    def __init__(self, config: EngineConfig, model: Any, model_config: Any,
                 tokenizer: Any = None, served_model_name: str | None = None) -> None:
        if config.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, not {config.role!r}")
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name or config.served_model_name or config.model
        device = torch.device(getattr(model, "device", "cpu"))
        self.dtype = resolve_dtype(config.dtype, device)
        bs = config.block_size
        kv_format = resolve_kv_format(config.kv_cache_dtype)
        num_blocks = num_blocks_for(model_config, bs, self.dtype, kv_cache_bytes(config, device), kv_format)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.runner = ModelRunner(model, model_config, bs, num_blocks, self.dtype, config.num_threads,
                                  cuda_graphs=not config.enforce_eager, max_batch=config.max_num_seqs,
                                  max_model_len=config.max_model_len, kv_format=kv_format,
                                  prefill_graph_tokens=min(config.max_num_batched_tokens, PREFILL_GRAPH_MAX_TOKENS),
                                  spec_tokens=spec_tokens(config))
        self.connector = config.kv_connector
        self.kv_loader: KVLoader | None = None
        if self.connector is not None:
            self.connector.bind(self.runner.kv_caches, bs)
            self.kv_loader = KVLoader(self.connector, self.runner.kv_caches[0].device)
        self.handoff = Handoff(self.block_manager, self.runner, config.kv_hold_ttl_s)
        limit = config.max_model_len or model_config.max_position_embeddings
        # a sequence can never outgrow the whole cache: cap it, or it would preempt itself forever
        self.max_model_len = min(limit, num_blocks * bs)
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.lora = build_manager(config.lora, model_config, device, self.dtype)
        self.runner.lora = self.lora
        self.runner.capture_lora_graphs()
        self.runner.lora_in_use = self._loras_in_use
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.connector, self.kv_loader,
                                   self.handoff, self.eos_token_ids, self.max_model_len,
                                   max_loras=config.lora.max_loras if self.lora is not None else 0)
        self.sampler = Sampler(config.seed)
        self.speculator = build_speculator(config, self, model, num_blocks)
        self.guided = None if tokenizer is None else GuidedVocab(tokenizer, model_config.vocab_size)
        self.last_step_time = 0.0
        self._step_ema = 0.0   # recent step times (the stall log's yardstick)
        self._sleep: Any = None      # sleep_mode.SleepMode after the first sleep

    def _loras_in_use(self) -> set[str]:
        return {s.params.lora_name for s in self.scheduler.requests.values()} - {None}

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        """Load weights and tokenizer from `config.model` (never from the network)."""
        from kvyard.common.tokenizer import load_tokenizer
        from kvyard.workers.model import load_model

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        src = resolve_model(config.model)
        device = resolve_device(config.device)
        model, model_config = load_model(src, resolve_dtype(config.dtype, device), config.max_model_len,
                                         device=device, quantization=config.quantization)
        tokenizer = load_tokenizer(config.model)
        return cls(config, model, model_config, tokenizer,
                   config.served_model_name or src.served_name)

    # ---- requests ------------------------------------------------------------
    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Reject what could never finish, before it takes a queue slot (safe from any thread)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; this model accepts at most "
                             f"{self.max_model_len - 1} prompt tokens")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if params.temperature < 0 or not 0.0 < params.top_p <= 1.0:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if params.top_k == 0 or params.top_k < -1:
            raise ValueError("top_k must be -1 (off) or positive")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}]")
        if not 0 <= params.min_tokens <= params.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if params.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be positive")
        if params.lora_name is not None and (self.lora is None or not self.lora.serves(params.lora_name)):
            raise ValueError(f"The model `{params.lora_name}` does not exist: no such LoRA adapter"
                             + ("" if self.lora is not None else " (LoRA is not enabled)"))

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    *, hold_kv: bool = False, hold_id: str | None = None,
                    parked: bool = False) -> None:
        """`hold_kv`: a P/D prefill; its prompt blocks are held for a pull, from the
        step that computes them (the hold, named `hold_id` if that is free, else
        after the request, is every output's `kv_hold`). `parked`: a P/D decode; it
        waits for `load_remote_kv` (or `unpark`) before it is scheduled."""
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), params,
                       arrival=time.monotonic(), hold_kv=hold_kv)
        if hold_kv:
            self.handoff.open(seq, hold_id)
        if params.seed is not None:
            seq.generator = make_generator(params.seed)
        if wants_guidance(params):
            if self.guided is None:
                raise ValueError("guided output (JSON, choices, regex) needs the model's tokenizer")
            seq.constraint = self.guided.constraint_for(params)
        if self.tokenizer is not None:
            # a few prompt tokens of context: some tokenizers' leading spaces depend on them
            seq.detokenizer = self.tokenizer.incremental_detokenizer(list(prompt_token_ids[-4:]))
        self.scheduler.add(seq, parked=parked)

    def load_remote_kv(self, request_id: str, remote: RemoteKV | None) -> int:
        """A parked request's remote prompt blocks arrived (None: they will not): the
        leading ones that match its own block hashes are written into free blocks and
        registered in the prefix cache, pinned to it until admission; then it queues,
        also when the load fails (it prefills itself; the error is raised). Returns how
        many blocks it got (0: it prefills the prompt itself)."""
        seq = self.scheduler.parked.get(request_id)
        if seq is None:
            return 0                       # aborted meanwhile
        try:
            self.handoff.load_remote(seq, remote)
        finally:
            self.scheduler.unpark(request_id)
        return len(seq.pinned_blocks)

    def idle_work(self) -> bool:
        """A little background work for an idle engine (faulting the CPU KV cache in:
        kv_prefault.py); False once there is none left."""
        return self.runner.prefault.step()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Free the request's blocks now; returns its final output, None if unknown."""
        seq = self.scheduler.abort(request_id)
        if seq is not None and seq.kv_hold is not None:
            self.handoff.fail(seq.kv_hold)
        return None if seq is None else output_of(seq, [], "")

    def request_ids(self) -> list[str]:
        """Every request in the engine (running, queued or parked)."""
        return list(self.scheduler.requests)

    def abort_all(self) -> list[RequestOutput]:
        out = [o for rid in self.request_ids() if (o := self.abort_request(rid))]
        self.handoff.drain()
        return out

    # ---- sleep mode (sleep_mode.py) -------------------------------------------
    @property
    def sleep_level(self) -> int:
        """0 awake, else the level it sleeps at."""
        return 0 if self._sleep is None else self._sleep.level

    def sleep(self, level: int = 1) -> None:
        from .sleep_mode import SleepMode

        if self._sleep is None:
            self._sleep = SleepMode(self)
        self._sleep.sleep(level)

    def wake_up(self) -> None:
        if self._sleep is not None:
            self._sleep.wake_up()

    def add_kv_event_listener(self, callback: Callable[[KVEvent], None]) -> None:
        """Blocks entering/leaving the prefix cache; called on the engine's thread, so keep it cheap."""
        self.block_manager.listeners.append(callback)

    def has_unfinished_requests(self) -> bool:
        """Requests in the engine, or blocks a connector load still holds for an aborted one."""
        return self.scheduler.has_unfinished() or self.scheduler.loads_in_flight > 0

    def has_schedulable_requests(self) -> bool:
        """Whether a step can make progress: parked requests wait for their remote KV or
        their connector load, not a step; a finished load is collected by one. Without a
        waker (`set_kv_load_waker`) a step waits for a load itself, so one in flight counts."""
        s = self.scheduler
        if s.running or (s.waiting and not s.blocked_on_loads):
            return True
        loader = self.kv_loader
        return loader is not None and loader.in_flight > 0 \
            and (loader.notify is None or loader.has_completed())

    def set_kv_load_waker(self, wake: Callable[[], None]) -> None:
        """`wake()` runs on the loader's thread whenever a connector load finishes (the
        async engine's step loop sleeps until then instead of polling)."""
        if self.kv_loader is not None:
            self.kv_loader.notify = wake

    # ---- the loop ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._wait_or_stall()
            return []
        t0 = time.perf_counter()
        spec = self.speculator
        if spec is not None:
            spec.plan(sched)    # drafts for decode rows: 1 + k positions each (spec/)
        logits, samplers, picked = self.runner.execute(sched)
        if spec is not None and len(samplers) > len(set(map(id, samplers))):
            samplers, tokens, logprobs = spec.sample(self._sample, logits, samplers, picked)
        else:
            tokens, logprobs = self._sample(logits, samplers, picked)
        outputs = self.scheduler.postprocess(sched, samplers, tokens, logprobs)
        self.last_step_time = dt = time.perf_counter() - t0
        if dt > STALL_MIN_S and dt > STALL_RATIO * self._step_ema > 0:
            log.debug("slow step: %.3f s (recent mean %.4f s): %d decode rows, %d prefill tokens in %d sequences, "
                     "adapters %s", dt, self._step_ema, sched.num_decodes, sched.num_tokens - sched.num_decodes,
                     len(sched.seqs) - sched.num_decodes,
                     sorted({s.params.lora_name or "-" for s in sched.seqs}))
        self._step_ema = dt if not self._step_ema else 0.9 * self._step_ema + 0.1 * dt
        if spec is not None:
            spec.observe(self.last_step_time)
        return outputs

    def _wait_or_stall(self) -> None:
        """An empty schedule: a connector load will change that (a synchronous driver
        waits for it here, not spinning), or nothing can, which is a bug."""
        if self.scheduler.loads_in_flight:
            if self.kv_loader.notify is None:
                self.kv_loader.wait(1.0)
        elif self.scheduler.waiting and not self.scheduler.running:
            # validate() makes every request fit an empty cache, so this is a bug: fail loudly
            raise RuntimeError("scheduler stalled: nothing runs and the queue head cannot start")

    def _sample(self, logits: torch.Tensor | None, seqs: list[Sequence],
                picked: list[int] | None) -> tuple[list[int], list]:
        """Tokens (and logprobs) for the sampling sequences; `picked` has the runner's
        greedy-screened rows already (-1: the rows `logits` covers, in order)."""
        if picked is None:
            return self._draw(logits, seqs) if seqs else ([], [])
        tokens, lps = list(picked), [None] * len(picked)
        rest = [i for i, tok in enumerate(picked) if tok < 0]
        if rest:
            for i, tok, lp in zip(rest, *self._draw(logits, [seqs[i] for i in rest])):
                tokens[i], lps[i] = tok, lp
        return tokens, lps

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list]:
        return self.sampler.sample(
            logits, [s.params for s in seqs], [s.generator for s in seqs],
            [(s.token_ids, s.num_prompt_tokens) for s in seqs], self.eos_token_ids,
            [s.constraint for s in seqs] if any(s.constraint for s in seqs) else None)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.parked)
            + len(self.scheduler.loading),
            kv_cache_usage=bm.usage,
            num_blocks=bm.num_blocks,
            block_size=bm.block_size,
            prefix_queries_tokens=bm.prefix_queries_tokens,
            prefix_hits_tokens=bm.prefix_hits_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.scheduler.prompt_tokens_total,
            generation_tokens_total=self.scheduler.generation_tokens_total,
            prompt_tokens_pending=self._prompt_tokens_pending(),
            **self._lora_stats(),
            spec_decode=None if self.speculator is None else self.speculator.stats.snapshot(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        """vLLM's lora_requests_info labels (read from the server's thread: copies first)."""
        if self.lora is None:
            return {}
        sch = self.scheduler

        def names(seqs) -> list[str]:
            return sorted({s.params.lora_name for s in seqs} - {None})
        return {"max_lora": self.config.lora.max_loras, "running_lora_adapters": names(list(sch.running)),
                "waiting_lora_adapters": names([*list(sch.waiting), *list(sch.parked.values()),
                                                *list(sch.loading.values())])}

    def _prompt_tokens_pending(self) -> int:
        sch = self.scheduler
        seqs = [*sch.waiting, *sch.running, *sch.parked.values(), *sch.loading.values()]
        return sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in seqs)
