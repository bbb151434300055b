"""Turns a scheduled batch into one model call and the logits to sample from.

Owns the paged KV cache tensors (one per layer, the layout in
`kvyard.workers.attention`). Logits are computed only for the last token of
sequences that sample this step: a partial prefill chunk produces no token,
and the LM head over a whole prompt would cost more than the rest of a small
model's step.
"""
from __future__ import annotations

import math
import mmap
import os
from functools import lru_cache

import torch

from kvyard.workers.attention import AttentionMetadata
from kvyard.workers.attention.kv_quant import KVFormat, cache_shape, row_bytes

from . import kv_layout
from .kv_prefault import Prefaulter
from .prompt_logprobs import append_prompt_logprobs
from .sampler import plain_greedy
from .scheduler import SchedulerOutput
from .sequence import Sequence
from .step_memory import keep_step_memory

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' is CUDA when a GPU is visible (vLLM's choice), else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"unsupported device {name!r}: auto, cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to torch")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """'auto' is bfloat16 on CUDA, and on a CPU only where it computes bf16 natively
    (emulated bf16 is slower than fp32)."""
    if name == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}: auto, float32 or bfloat16") from None


def kv_block_bytes(model_config, block_size: int, dtype: torch.dtype, kv_format: KVFormat | None = None) -> int:
    """Bytes one block costs across all layers (K and V); a quantized `kv_format` stores
    one-byte codes and a scale per row (attention/kv_quant.py)."""
    row = row_bytes(model_config.head_dim, kv_format, torch.empty((), dtype=dtype).element_size())
    return 2 * block_size * model_config.num_kv_heads * row * model_config.num_layers


def num_blocks_for(model_config, block_size: int, dtype: torch.dtype, memory_bytes: int,
                   kv_format: KVFormat | None = None) -> int:
    return memory_bytes // kv_block_bytes(model_config, block_size, dtype, kv_format)


CPU_KV_CACHE_BYTES = 1 << 30
# Room left beside the KV cache on a GPU for a step's activations, the decode graphs'
# pool and cuBLAS workspaces (an 8B step at 1,024 tokens needs ~0.6 GiB).
CUDA_ACTIVATION_RESERVE = 2 << 30


def kv_cache_bytes(config, device: torch.device) -> int:
    """The KV cache's size: `kv_cache_memory_bytes` when set; on CUDA otherwise vLLM's rule,
    `gpu_memory_utilization` of the card's memory minus what is in use now (the weights,
    anything else on the card) and a reserve for activations; on the CPU 1 GiB."""
    if config.kv_cache_memory_bytes:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        return CPU_KV_CACHE_BYTES
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {config.gpu_memory_utilization}")
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * config.gpu_memory_utilization) - (total - free) - CUDA_ACTIVATION_RESERVE
    if budget <= 0:
        raise ValueError(f"no room for a KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f}, "
                         f"gpu_memory_utilization {config.gpu_memory_utilization}")
    return budget


def _passive_omp() -> bool:
    """Whether idle OpenMP workers sleep at once (PASSIVE without a GOMP_SPINCOUNT of its own).
    With some spinning, two threads win again at batch 1 (measured 43.8 -> 47.7 tok/s)."""
    spin = os.environ.get("GOMP_SPINCOUNT", "0").strip() not in ("", "0")
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" and not spin


PROMPT_LOGITS_ROWS = 256
# Below this many plain greedy rows the model's greedy screen (a bf16 head: twice the bytes
# of the demo's 8-bit one) costs more than it saves. Screen vs full head, best of 5
# (demo model, float32): 1.57 vs 1.15 ms at 2 rows, 1.62 vs 1.65 at 4, 1.64 vs 2.22 at 6,
# 3.0 vs 7.0 at 16, 5.7 vs 11.2 at 32.
GREEDY_SCREEN_MIN_ROWS = 5


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            maps: list[mmap.mmap]) -> torch.Tensor:
    """A zeroed KV cache. On the CPU from an anonymous mapping (appended to `maps`), which
    the kernel hands out zero-filled page by page on first touch: torch.zeros would memset
    (and fault in) the whole cache before the worker listens, 0.4-1.4 s of a cold start for
    the 1 GiB default; the engine faults it in while idle instead (kv_prefault.py)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    m = mmap.mmap(-1, max(nbytes, 1))
    maps.append(m)
    return torch.frombuffer(m, dtype=dtype, count=math.prod(shape)).view(shape)


# One sequence's prefill steps up to this many tokens replay CUDA graphs (cuda_prefill.py).
# On an H200 (8B shape, docs/bench/gpu-wave3-prefill.json) a 512-token prefill took 1.7x less
# time from a graph; 1,024-token chunks gained nothing (2k prompt 1.03x, 8k 0.92x), so larger
# steps stay eager.
PREFILL_GRAPH_MAX_TOKENS = 512

class ModelRunner:
    def __init__(self, model, model_config, block_size: int, num_blocks: int, dtype: torch.dtype,
                 num_threads: int | None = None, single_thread_max_tokens: int | None = None,
                 cuda_graphs: bool = True, max_batch: int = 128, max_model_len: int | None = None,
                 fixed_addresses: bool = True, kv_format: KVFormat | None = None,
                 prefill_graph_tokens: int = 0, spec_tokens: int = 0) -> None:
        """On CUDA (the model's device) decode steps of up to `max_batch` sequences of up
        to `max_model_len` tokens replay CUDA graphs unless `cuda_graphs` is False
        (--enforce-eager), and so do one sequence's prefill/extend steps of up to
        `prefill_graph_tokens` new tokens (cuda_prefill.py; 0: none); plain greedy rows take
        their argmax on the GPU. With
        `fixed_addresses` the weights and KV cache live in sleep_arena.py's arenas, so a
        wake from sleep keeps the graphs (False, or no driver VMM API: plain allocations).
        A quantized `kv_format` stores the cache as one-byte codes with per-row scales."""
        # OpenMP's thread count is per calling thread: the engine may run steps on a
        # thread of its own, which would not inherit a set_num_threads made elsewhere,
        # so every step sets it (a no-op when unchanged).
        self.num_threads = num_threads or torch.get_num_threads()
        # With passive OpenMP waiting, each parallel region wakes sleeping workers
        # (a futex round trip); a few-token step runs ~600 regions, so one thread is
        # faster: measured 33.5 -> 20.5 ms per batch-1 decode step on 2 cores.
        if single_thread_max_tokens is None:
            single_thread_max_tokens = 8 if _passive_omp() else 0
        self.single_thread_max_tokens = single_thread_max_tokens
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = torch.device(getattr(model, "device", "cpu"))
        if self.device.type == "cpu":
            keep_step_memory()  # a step's buffers reuse memory, not fresh mappings (step_memory.py)
        shape = cache_shape((2, num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim),
                            kv_format)
        self.kv_dtype = dtype if kv_format is None else kv_format.dtype
        self.kv_hnd = kv_layout.uses_hnd(kv_format and kv_format.name, self.device)   # kv_layout.py
        maps: list[mmap.mmap] = []
        self.kv_caches = [kv_layout.allocate(shape, self.kv_hnd,
                                             lambda ps: _zeroed(ps, self.kv_dtype, self.device, maps))
                          for _ in range(model_config.num_layers)]
        self.prefault = Prefaulter(maps)  # the engine's idle work (async_engine.py)
        self.arenas = None  # sleep_arena.SleepArenas on CUDA with fixed_addresses
        if self.device.type == "cuda" and fixed_addresses:
            self._move_to_arenas(shape)
        self.lora = None  # workers.lora.manager.LoRAManager with --enable-lora (set by the engine)
        self.lora_in_use = set  # the adapters requests in the engine name (kept in host memory)
        self.graphs = None
        self.lora_graphs = None  # cuda_lora_graphs.LoRADecodeGraphs (capture_lora_graphs)
        self.prefill_graphs = None
        self.verify_graphs = None  # speculative verify steps (1 + spec_tokens per row) as graphs
        self.spec_tokens = spec_tokens
        self._graph_shape = None  # (max batch, max blocks) when decode steps are CUDA graphs
        self._prefill_graph_tokens = prefill_graph_tokens if cuda_graphs else 0
        if self.device.type == "cuda" and cuda_graphs:
            max_len = min(max_model_len or model_config.max_position_embeddings, num_blocks * block_size)
            self._graph_shape = (max_batch, -(-max_len // block_size))
        self.rebuild_device_state()

    def _move_to_arenas(self, shape: tuple[int, ...]) -> None:
        """The plain KV allocation gives way to the KV arena, the weights move to theirs."""
        from .sleep_arena import SleepArenas

        self.kv_caches = []
        torch.cuda.empty_cache()
        self.arenas = SleepArenas.create(self.model, kv_layout.physical_shape(shape, self.kv_hnd), self.kv_dtype,
                                         self.model_config.num_layers, self.device)
        if self.arenas is not None:
            self.kv_caches = [kv_layout.logical(c, self.kv_hnd) for c in self.arenas.kv_caches]
        else:
            self.kv_caches = [kv_layout.allocate(shape, self.kv_hnd, lambda ps: torch.zeros(
                ps, dtype=self.kv_dtype, device=self.device)) for _ in range(self.model_config.num_layers)]

    def rebuild_device_state(self) -> None:
        """CUDA: capture the decode graphs over the current weights and KV cache, then warm
        up the eager path (at start, and again after a wake from sleep: sleep_mode.py)."""
        if self._graph_shape is not None:
            from .cuda_runner import DecodeGraphs

            self.graphs = self.verify_graphs = self.lora_graphs = None
            self.graphs = DecodeGraphs(self.model, self.kv_caches, *self._graph_shape)
            if self._prefill_graph_tokens:
                from .cuda_prefill import PrefillGraphs

                self.prefill_graphs = None
                self.prefill_graphs = PrefillGraphs(self.model, self.kv_caches, self._prefill_graph_tokens,
                                                    self._graph_shape[1])
            if self.spec_tokens:
                self.verify_graphs = DecodeGraphs(self.model, self.kv_caches, *self._graph_shape,
                                                  q=1 + self.spec_tokens)
            self.capture_lora_graphs()
        if self.device.type == "cuda":
            self._warm_up()

    def capture_lora_graphs(self) -> None:
        """With --enable-lora and decode graphs: every batch size's LoRA decode graph, now
        (the engine calls this once it has set `lora`; a wake calls it again)."""
        if self.lora is not None and self._graph_shape is not None:
            from .cuda_lora_graphs import LoRADecodeGraphs

            self.lora_graphs = None
            self.lora_graphs = LoRADecodeGraphs(self.model, self.kv_caches, *self._graph_shape, self.lora)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One prefill and one decode through the eager path before serving: Triton compiles a
        kernel at its first launch, which would otherwise land on the first request. Slots are
        -1, so nothing reaches the cache."""
        dev, bs = self.device, self.block_size
        for n, nd in ((min(16, bs * self.num_blocks), 0), (1, 1)):
            meta = AttentionMetadata(slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
                                     query_start_loc=[0, n], seq_lens=[n], num_decodes=nd,
                                     block_tables=torch.zeros(1, -(-n // bs), dtype=torch.int64, device=dev))
            h = self.model.forward(torch.zeros(n, dtype=torch.int64, device=dev), torch.arange(n, device=dev),
                                   self.kv_caches, meta)
            self.model.compute_logits(h[-1:]).argmax(-1).tolist()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput
                ) -> tuple[torch.Tensor | None, list[Sequence], list[int] | None]:
        """Run the batch; returns (logits, the n sequences that sample, picked).

        Rows whose token is just the argmax of their logits (sampler.plain_greedy): where
        the model has a greedy screen and enough such rows, those get their token here
        (picked[i], the same token the logits' argmax gives) and the logits [r, V]
        float32 cover only the other r rows (picked[i] = -1), in order; otherwise picked
        is None and the logits cover all n.

        Sequences that want prompt logprobs get the entries of the prompt positions this
        step computed (prompt_logprobs.py), from logits at most PROMPT_LOGITS_ROWS at a
        time (a 1,024-token chunk of a 49k vocabulary would be 200 MB at once)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        prompt_spans: list[tuple[Sequence, int, int, int]] = []  # (seq, first pos, first row, rows)
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            c = seq.num_computed_tokens
            end = c + n
            draft = seq.spec_token_ids   # speculative decoding: its last token, then the draft
            if n == 1:
                ids.append(seq.token_ids[c])
                pos.append(c)
            else:
                ids.extend(seq.token_ids[c:end] + draft if draft else seq.token_ids[c:end])
                pos.extend(range(c, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(seq.block_table)
            if draft:   # a row per position: the target's choice after each draft prefix
                sample_rows.extend(range(qsl[-1] - n, qsl[-1]))
                samplers.extend([seq] * n)
            elif end == seq.num_tokens:
                sample_rows.append(qsl[-1] - 1)
                samplers.append(seq)
            if seq.wants_prompt_logits:
                # position p predicts token p + 1: entry p + 1 of seq.prompt_logprobs
                lo = max(c, max(1, len(seq.prompt_logprobs)) - 1)
                hi = min(end, seq.num_prompt_tokens - 1)
                if hi > lo:
                    prompt_spans.append((seq, lo, qsl[-2] + lo - c, hi - lo))
        lora = None
        if self.lora is not None and any(s.params.lora_name for s in sched.seqs):
            rows = [s.params.lora_name for s, n in zip(sched.seqs, sched.num_new_tokens) for _ in range(n)]
            lora = self.lora.batch(rows, self.lora_in_use())
        cuda = self.device.type == "cuda"
        if cuda and self.graphs is not None and sched.num_decodes == len(tables) and not prompt_spans \
                and self.graphs.fits(len(tables), max(len(t) for t in tables)):
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
            if lora is None:
                logits = self.graphs.run(ids, pos, slots, seq_lens, tables)
            else:
                if self.lora_graphs is None:
                    self.capture_lora_graphs()
                logits = self.lora_graphs.run_lora(ids, pos, slots, seq_lens, tables, lora.row_slots)
            return self._gpu_sample(logits, samplers)
        vg = self.verify_graphs
        if cuda and vg is not None and not prompt_spans and len(samplers) == len(ids) \
                and vg.fits(len(tables), max(len(t) for t in tables)):
            # decodes and drafted rows only (every position samples): one verify graph
            logits, rows = vg.run_verify(sched.seqs, bs)
            return self._gpu_sample(logits[torch.tensor(rows, device=logits.device)], samplers)
        if cuda and self.prefill_graphs is not None and len(tables) == 1 and not sched.num_decodes \
                and len(samplers) <= 1 and not prompt_spans \
                and self.prefill_graphs.fits(len(ids), len(tables[0])):
            t = tables[0]
            logits = self.prefill_graphs.run(ids, pos, [t[p // bs] * bs + p % bs for p in pos], seq_lens[0], t)
            return self._gpu_sample(logits, samplers) if samplers else (None, samplers, None)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        positions = torch.tensor(pos, dtype=torch.int64)
        input_ids = torch.tensor(ids, dtype=torch.int64)
        row = torch.arange(len(tables))
        if len(ids) != len(tables):             # some sequence brings several tokens
            row = torch.repeat_interleave(row, torch.tensor(sched.num_new_tokens, dtype=torch.int64))
        slot_mapping = block_tables[row, positions // bs] * bs + positions % bs
        if cuda:
            dev = self.device
            input_ids, positions = input_ids.to(dev, non_blocking=True), positions.to(dev, non_blocking=True)
            slot_mapping, block_tables = slot_mapping.to(dev), block_tables.to(dev)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=block_tables,
            num_decodes=sched.num_decodes,
        )
        threads = 1 if len(ids) <= self.single_thread_max_tokens else self.num_threads
        if lora is not None and lora.cpu is None and getattr(self.model, "gemm", None) is not None:
            # torch's LoRA GEMMs (no lora.c) are faster on one thread than waking an OpenMP
            # team beside gemm.c's (measured 0.05 vs 35 ms per pair); lora.c runs on gemm.c's team
            threads = 1
        before = torch.get_num_threads()
        if before != threads:
            torch.set_num_threads(threads)
        try:
            # Only the sampled rows' hidden states are needed unless prompt logprobs are
            # (the model may then skip the other rows' last-layer MLP).
            narrow = not prompt_spans and len(sample_rows) < len(ids)
            hidden = self.model.forward(input_ids, positions, self.kv_caches, meta,
                                        torch.tensor(sample_rows, dtype=torch.int64,  # may be empty
                                                     device=self.device) if narrow else None,
                                        **({"lora": lora} if lora is not None else {}))
            for seq, p0, r0, n in prompt_spans:
                for j in range(0, n, PROMPT_LOGITS_ROWS):
                    k = min(PROMPT_LOGITS_ROWS, n - j)
                    append_prompt_logprobs(seq, p0 + j, self.model.compute_logits(hidden[r0 + j:r0 + j + k]).float().cpu())
            if not samplers:
                return None, samplers, None
            if narrow or len(sample_rows) == hidden.shape[0]:
                last = hidden
            else:
                last = hidden[torch.tensor(sample_rows, device=hidden.device)]
            if cuda:
                return self._gpu_sample(self.model.compute_logits(last), samplers)
            fast = []
            if getattr(self.model, "greedy", None) is not None:
                fast = [i for i, seq in enumerate(samplers) if plain_greedy(seq)]
            if len(fast) < GREEDY_SCREEN_MIN_ROWS:
                return self.model.compute_logits(last).float(), samplers, None
            picked = [-1] * len(samplers)
            for i, tok in zip(fast, self.model.greedy_tokens(last[fast] if len(fast) < len(samplers) else last).tolist()):
                picked[i] = tok
            rest = [i for i, tok in enumerate(picked) if tok < 0]
            logits = self.model.compute_logits(last[rest]).float() if rest else None
            return logits, samplers, picked
        finally:
            if before != threads:
                torch.set_num_threads(before)  # in-process callers (LLM.generate, a bench) keep theirs

    @staticmethod
    def _gpu_sample(logits: torch.Tensor, samplers: list[Sequence]
                    ) -> tuple[torch.Tensor | None, list[Sequence], list[int] | None]:
        """Plain greedy rows' tokens by argmax on the GPU (reading them is the step's one
        sync); the other rows' logits stay on the GPU for the sampler, which draws there
        and reads back only the sampled ids (sampler.py)."""
        fast = [i for i, seq in enumerate(samplers) if plain_greedy(seq)]
        if not fast:
            return logits.float(), samplers, None
        chosen = set(fast)
        rest = [i for i in range(len(samplers)) if i not in chosen]
        toks = logits.argmax(dim=-1) if not rest else logits[torch.tensor(fast, device=logits.device)].argmax(dim=-1)
        rest_logits = logits[torch.tensor(rest, device=logits.device)].float() if rest else None
        picked = [-1] * len(samplers)
        for i, tok in zip(fast, toks.tolist()):
            picked[i] = tok
        return rest_logits, samplers, picked
