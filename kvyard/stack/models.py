"""`kvyard up --model NAME=SOURCE …`: several base models behind one Envoy and EPP.

Each named model gets a pool of its own: `--workers` workers (or `--sim` pods, or the P/D
split) started from SOURCE and serving NAME (`--served-model-name`); the endpoints file
labels every endpoint with its pool (the model's name) and the EPP gets a models file
(`kvyard.epp.models`) mapping each name to its pool, so a request goes to the pool of its
`model`, `/v1/models` lists every model and an unknown name is a 404. A bare
`--model SOURCE` keeps its meaning: one pool, no labels, no models file.

`--adapter [MODEL:]NAME=PATH` (repeatable) gives MODEL's workers (default: the first or only
model) a LoRA adapter with vLLM's flags (`--enable-lora --lora-modules NAME=PATH
--max-loras N`; simulated pods take `--lora-modules`), and the EPP a models file naming it,
so a request for NAME goes to those workers and the lora-affinity scorer sees it.

Every pool's workers publish their KV events on ports of their own (`kv_events.py`), named
in the endpoints file beside the pool, and the models file names each pool's tokenizer (its
SOURCE), so the EPP keys each pool's prompts as its workers do and scores every pool
precisely. The EPP's index is one key space (token ids, seeded per adapter only), but a
request is scored only against its own pool's endpoints (`Director.candidates`), so alpha's
blocks never count for a request to beta even where both hold the same tokens.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

from kvyard.stack import procs
from kvyard.stack.kv_events import EventPorts, wanted
from kvyard.stack.procs import Proc
from kvyard.stack.readiness import ready_check
from kvyard.stack.spec import StackSpec

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


def parse_models(values: list[str] | None) -> tuple[str, list[tuple[str, str]]]:
    """`--model` values as (the first source, [(name, source)]); [] for one bare SOURCE.
    Raises ValueError for a mix, a bad or a repeated name."""
    values = values or ["demo"]
    named = []
    for v in values:
        name, sep, source = v.partition("=")
        if not sep:
            if len(values) > 1:
                raise ValueError(f"--model {v!r}: with several models, each is NAME=SOURCE")
            return v, []
        if not _NAME.match(name) or not source:
            raise ValueError(f"--model {v!r}: want NAME=SOURCE (NAME: letters, digits, _.:-)")
        if any(name == n for n, _ in named):
            raise ValueError(f"--model: {name!r} is named twice")
        named.append((name, source))
    return named[0][1], named


def parse_adapters(values: list[str] | None, named: list[tuple[str, str]]
                   ) -> list[tuple[str, str, str]]:
    """`--adapter [MODEL:]NAME=PATH` values as (model, name, path); model "" for the one
    unnamed model. Raises ValueError for a bad form, an unknown model or a repeated name."""
    models = [n for n, _ in named]
    out: list[tuple[str, str, str]] = []
    for v in values or []:
        head, sep, path = v.partition("=")
        model, colon, name = head.rpartition(":")
        if not sep or not path or not _NAME.match(name or "-"):
            raise ValueError(f"--adapter {v!r}: want [MODEL:]NAME=PATH")
        if colon and model not in models:
            raise ValueError(f"--adapter {v!r}: {model!r} is not a --model NAME "
                             f"({', '.join(models) or 'none named'})")
        if name in models or any(name == n for _, n, _ in out):
            raise ValueError(f"--adapter {v!r}: {name!r} is named twice")
        out.append((model or (models[0] if models else ""), name, path))
    return out


def lora_args(spec: StackSpec, model: str) -> list[str]:
    """The workers' LoRA flags for `model`'s adapters ("": the one unnamed model's)."""
    mods = [f"{n}={p}" for m, n, p in spec.adapters if m == model]
    if not mods:
        return []
    return ([] if spec.sim else ["--enable-lora"]) + ["--lora-modules", *mods,
                                                      "--max-loras", str(spec.max_loras)]


def models_file(path: Path, spec: StackSpec) -> Path | None:
    """The EPP's --models-file: each named model its own pool, with its adapters; one
    unnamed model with adapters: its served name and adapters, no pool. None: not needed."""
    if spec.named_models:
        rows = [{"name": n, "pool": n, "adapters": [a for m, a, _ in spec.adapters if m == n],
                 "tokenizer": source}  # the EPP keys each pool's prompts as its workers do
                for n, source in spec.named_models]
    elif spec.adapters:
        from kvyard.common.models import resolve_model

        rows = [{"name": resolve_model(spec.model).served_name,
                 "adapters": [a for _, a, _ in spec.adapters]}]
    else:
        return None
    path.write_text(json.dumps({"models": rows}))
    return path


def spawn_model_pools(spec: StackSpec, roles: list[str], taken: set[int], logs: Path,
                      kv_args: list[str], kv_env_files: dict[str, str], pd_key: Path | None,
                      add: Callable[[Proc], Proc]
                      ) -> tuple[list[str], list[str], list[str],
                                 list[tuple[Proc, Callable[[], bool]]],
                                 dict[str, tuple[str, str]]]:
    """Every model's pool: (addresses, their roles, their pools, readiness checks, each
    publishing address's KV-event streams)."""
    from kvyard.stack.commands import worker_cmd

    addresses: list[str] = []
    all_roles: list[str] = []
    pools: list[str] = []
    checks: list[tuple[Proc, Callable[[], bool]]] = []
    streams: dict[str, tuple[str, str]] = {}
    for k, (name, source) in enumerate(spec.named_models):
        events = EventPorts.allocate(len(roles), taken) if wanted(spec) else None
        base = spec.worker_base_port
        lora = lora_args(spec, name)
        sub = replace(spec, model=source, named_models=[],
                      worker_base_port=None if base is None else base + k * len(roles),
                      worker_args=[*spec.worker_args, "--served-model-name", name, *lora],
                      sim_args=[*spec.sim_args, "--served-model-name", name, *lora],
                      standin_args=[*spec.standin_args, "--model", name])
        if spec.sim:
            from kvyard.stack.sim_pool import spawn_sim_pods

            got, more = spawn_sim_pods(sub, roles, taken, logs, pd_key, add,
                                       name_prefix=f"sim-{name}-",
                                       extra=events.flag() if events else [])
            checks += more
        else:
            got = []
            for i, role in enumerate(roles):
                port = procs.free_port(None if sub.worker_base_port is None
                                       else sub.worker_base_port + i, taken)
                got.append(f"127.0.0.1:{port}")
                cmd = worker_cmd(sub, port, kv_args=kv_args, role=role, pd_key=pd_key)
                p = add(procs.spawn(f"worker-{name}-{i}",
                                    cmd + (events.flag(i) if events else []),
                                    logs / f"worker-{name}-{i}.log", env_files=kv_env_files,
                                    ports={"http": port}))
                checks.append((p, ready_check(f"http://127.0.0.1:{port}/health")))
        addresses += got
        streams |= events.streams(got) if events else {}
        all_roles += roles
        pools += [name] * len(roles)
    return addresses, all_roles, pools, checks, streams
