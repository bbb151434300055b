"""The synchronous engine: one `step()` = schedule, run the model, sample, emit outputs.

Single-threaded on purpose: every structure it touches (sequences, block
tables, the prefix cache) is owned by the thread calling `step()`, so none of
them needs a lock. `AsyncLLMEngine` drives it from its own thread. The one
other thread is the KV loader's (kv_loads.py): it fills the cache rows of
blocks a parked request owns and posts the job back; a driver that installs
`set_kv_load_waker` hears when, one that does not has `step()` wait for it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence as Seq

import numpy as np
import torch

from kvyard.common.models import resolve_model

from .api import EngineStats, RemoteKV, RequestOutput, SamplingParams, TokenLogprob
from .block_manager import BlockManager, KVEvent
from .choice_mode import ChoiceState
from .config import EngineConfig
from .kv_blocks import scatter
from .kv_holds import KVHolds
from .kv_loads import KVLoader
from .model_runner import ModelRunner, kv_cache_bytes, num_blocks_for, resolve_device, resolve_dtype
from .regex_mode import RegexState, compile_regex
from .json_mode import JsonConstraint, JsonState
from .json_schema import SchemaState, compile_schema
from .sampler import GREEDY_EPS, Sampler, make_generator
from .scheduler import Scheduler
from .sequence import Sequence
from .stopping import append_token

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs and OpenAI's top_logprobs limit


def _plain_greedy(seq: Sequence) -> bool:
    """Whether the sequence's next token is the bare argmax of its logits (no sampling,
    adjustment, constraint or logprobs), so the runner may pick it without them."""
    p = seq.params
    return p.temperature <= GREEDY_EPS and p.logprobs is None and not p.adjusts_logits \
        and seq.constraint is None


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
        num_blocks = num_blocks_for(model_config, bs, self.dtype, kv_cache_bytes(config, device))
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.runner = ModelRunner(model, model_config, bs, num_blocks, self.dtype, config.num_threads,
                                  cuda_graphs=not config.enforce_eager, max_batch=config.max_num_seqs,
                                  max_model_len=config.max_model_len)
        self.connector = config.kv_connector
        self.kv_loader: KVLoader | None = None
        if self.connector is not None:
            self.connector.bind(self.runner.kv_caches, bs)
            self.kv_loader = KVLoader(self.connector, self.runner.kv_caches[0].device)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.connector, self.kv_loader)
        self.sampler = Sampler(config.seed)
        self.kv_holds = KVHolds(config.kv_hold_ttl_s)
        self.remote_kv_blocks = 0   # P/D decode: blocks loaded from a prefill worker
        limit = config.max_model_len or model_config.max_position_embeddings
        # a sequence can never outgrow the whole cache: cap it, or it would preempt itself forever
        self.max_model_len = min(limit, num_blocks * bs)
        self.eos_token_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_step_time = 0.0
        self._texts: dict[int, str] = {}
        self._first_code_table: np.ndarray | None = None
        self._sleep: Any = None      # sleep_mode.SleepMode after the first sleep

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
                                         device=device)
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
            seq.kv_hold = (hold_id and self.kv_holds.open(hold_id)) \
                or self.kv_holds.open(request_id)
            if seq.kv_hold is None:
                raise ValueError(f"request id {request_id!r} is already in use")
        if params.seed is not None:
            seq.generator = make_generator(params.seed)
        if params.json_object or params.json_schema is not None or params.guided_choice \
                or params.guided_regex:
            if self.tokenizer is None:
                raise ValueError("guided output (JSON, choices, regex) needs the model's tokenizer")
            state = ChoiceState.start(params.guided_choice) if params.guided_choice else \
                RegexState.start(compile_regex(params.guided_regex)) if params.guided_regex else \
                SchemaState.start(compile_schema(params.json_schema)) \
                if params.json_schema is not None else JsonState()
            seq.constraint = JsonConstraint(self._token_text, state, first_codes=self._first_codes())
        if self.tokenizer is not None:
            # a few prompt tokens of context: some tokenizers' leading spaces depend on them
            seq.detokenizer = self.tokenizer.incremental_detokenizer(list(prompt_token_ids[-4:]))
        self.scheduler.add(seq, parked=parked)

    def load_remote_kv(self, request_id: str, remote: RemoteKV | None) -> int:
        """A parked request's remote prompt blocks arrived (None: they will not): the
        leading ones that match its own block hashes are written into free blocks and
        registered in the prefix cache, pinned to it until admission; then it queues.
        Returns how many blocks it got (0: it prefills the prompt itself)."""
        seq = self.scheduler.parked.get(request_id)
        if seq is None:
            return 0                       # aborted meanwhile
        bm = self.block_manager
        bs = bm.block_size
        pins = seq.pinned_blocks
        writes: list[tuple[int, object]] = []
        if remote is not None:
            own = seq.update_block_hashes(bs)
            limit = min((seq.num_tokens - 1) // bs, len(own))
            for i, (h, payload) in enumerate(zip(remote.block_hashes, remote.payloads)):
                if i >= limit or own[i] != h:
                    break
                b = bm.pin_cached(h)
                if b is None:
                    b = bm.take_for(h, own[i - 1] if i else None,
                                    seq.token_ids[i * bs:(i + 1) * bs])
                    if b is None:
                        break
                    writes.append((b, payload))
                pins.append(b)
            try:
                scatter(self.runner.kv_caches, [b for b, _ in writes], [p for _, p in writes])
            except Exception:
                for b, _ in writes:      # never leave a block cached under a hash it lacks
                    bm.uncache(b)
                raise
        self.remote_kv_blocks += len(writes)
        self.scheduler.unpark(request_id)
        return len(pins)

    def idle_work(self) -> bool:
        """A little background work for an idle engine (faulting the CPU KV cache in:
        kv_prefault.py); False once there is none left."""
        return self.runner.prefault.step()

    def reap_kv_holds(self) -> int:
        """Give back the blocks of pulled and expired holds; returns how many blocks."""
        n = 0
        for ids in self.kv_holds.reap():
            self.block_manager.release(ids)
            n += len(ids)
        return n

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Free the request's blocks now; returns its final output, None if unknown."""
        seq = self.scheduler.abort(request_id)
        if seq is not None and seq.kv_hold is not None:
            self.kv_holds.fail(seq.kv_hold)
            self.reap_kv_holds()            # unless a pull reads it, its blocks go back now
        return None if seq is None else self._output(seq, [], "")

    def _publish(self, seq: Sequence) -> None:
        """The prompt blocks this step completed, referenced for the request's hold (a
        streamed pull may send them now; a preemption cannot free them)."""
        hold, bs = seq.kv_hold, self.block_manager.block_size
        have = len(hold.block_ids)
        full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // bs
        last = seq.num_computed_tokens >= seq.num_prompt_tokens
        if full <= have:
            if last:
                self.kv_holds.complete(hold)
            return
        ids = seq.block_table[have:full]
        self.block_manager.ref(ids)
        if not self.kv_holds.publish(hold, ids, seq.update_block_hashes(bs)[have:full], last):
            self.block_manager.release(ids)   # its pull ended already: nobody sends them

    def abort_all(self) -> list[RequestOutput]:
        out = [o for rid in list(self.scheduler.requests) if (o := self.abort_request(rid))]
        for ids in self.kv_holds.drain():
            self.block_manager.release(ids)
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
            if self.scheduler.loads_in_flight:
                if self.kv_loader.notify is None:  # a synchronous driver: wait, do not spin
                    self.kv_loader.wait(1.0)
                return []
            if self.scheduler.waiting and not self.scheduler.running:
                # validate() makes every request fit an empty cache, so this is a bug: fail loudly
                raise RuntimeError("scheduler stalled: nothing runs and the queue head cannot start")
            return []
        t0 = time.perf_counter()
        logits, samplers, picked = self.runner.execute(sched, self._prompt_logits, _plain_greedy)
        tokens: list[int] = []
        lps: list = []
        if picked is not None:  # the screened greedy rows have their tokens; sample the rest
            tokens, lps = list(picked), [None] * len(picked)
            rest = [i for i, tok in enumerate(picked) if tok < 0]
            if rest:
                for i, tok, lp in zip(rest, *self._sample(logits, [samplers[i] for i in rest])):
                    tokens[i], lps[i] = tok, lp
        elif samplers:
            tokens, lps = self._sample(logits, samplers)
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            seq.num_computed_tokens += n
            newly = self.block_manager.cache_blocks(seq)
            if newly and self.connector is not None:
                self.connector.save([h for h, _ in newly], [b for _, b in newly])
            if seq.kv_hold is not None:
                self._publish(seq)
        outputs: list[RequestOutput] = []
        for seq, tok, lp in zip(samplers, tokens, lps):
            if seq.num_output_tokens == 0:
                self.prompt_tokens_total += seq.num_prompt_tokens
            self.generation_tokens_total += 1
            delta, reason = append_token(seq, tok, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            out = self._output(seq, [tok], delta, None if lp is None else [lp])
            if seq.kv_hold is not None:
                out.kv_hold = seq.kv_hold
                if reason is not None:      # complete already, unless it ended mid-prompt
                    self.kv_holds.complete(seq.kv_hold)
            if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 1:
                out.prompt_logprobs = seq.prompt_logprobs or [None]
            outputs.append(out)
        self.last_step_time = time.perf_counter() - t0
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list]:
        return self.sampler.sample(
            logits, [s.params for s in seqs], [s.generator for s in seqs],
            [(s.token_ids, s.num_prompt_tokens) for s in seqs], self.eos_token_ids,
            [s.constraint for s in seqs] if any(s.constraint for s in seqs) else None)

    def _first_codes(self) -> np.ndarray:
        """Each token's first character (code point; -1 for no text), for the constrained
        sampler's vectorised prefilter (JsonConstraint.prefilter); built at first use."""
        if self._first_code_table is None:
            n = max(self.model_config.vocab_size, self.tokenizer.vocab_size)
            table = np.full(n, -1, dtype=np.int32)
            for t in range(min(n, self.tokenizer.vocab_size)):
                text = self._token_text(t)
                if text:
                    table[t] = ord(text[0])
            self._first_code_table = table
        return self._first_code_table

    def _token_text(self, token_id: int) -> str:
        """What a token adds to the text, cached (JSON mode checks the same few often)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.token_text(token_id)
        return text

    def _prompt_logits(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        """Prompt logprobs for positions first.. (each predicting the next prompt token),
        appended in order; raw log_softmax, like the sampled tokens' logprobs."""
        entries = seq.prompt_logprobs
        if not entries:
            entries.append(None)             # the first token has nothing before it
        if first != len(entries) - 1:
            raise RuntimeError(f"prompt logits out of order: position {first}, "
                               f"{len(entries)} entries")
        lp = torch.log_softmax(logits, dim=-1)
        targets = seq.token_ids[first + 1:first + 1 + lp.shape[0]]
        chosen_t = lp.gather(1, torch.tensor(targets).unsqueeze(1))
        ranks = ((lp > chosen_t).sum(dim=1) + 1).tolist()  # vLLM's prompt_logprobs report it
        chosen = chosen_t.squeeze(1).tolist()
        k = seq.params.prompt_logprobs or 0
        top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
        for j, t in enumerate(targets):
            top = list(zip(top_i[j].tolist(), top_v[j].tolist())) if k else []
            entries.append(TokenLogprob(t, chosen[j], top, ranks[j]))

    def _output(self, seq: Sequence, new_ids: list[int], delta: str,
                logprobs: list | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            text_delta=delta,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
        )

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
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prompt_tokens_pending=self._prompt_tokens_pending(),
        )

    def _prompt_tokens_pending(self) -> int:
        sch = self.scheduler
        seqs = [*sch.waiting, *sch.running, *sch.parked.values(), *sch.loading.values()]
        return sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in seqs)
