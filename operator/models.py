"""Several base models and LoRA adapters in one InferenceService (`spec.models`,
`spec.adapters`, `spec.engine.maxLoras`): typed, checked, rendered.

Why `models:` in one InferenceService rather than one InferenceService per model sharing
a gateway: one EPP then sees every pool and routes by the body's `model` itself (its
models file, kvyard.epp.models), so no body-based router is needed in front of several
EPPs, one gateway and one status cover the whole endpoint, and the pools share the
routing, kvstore and scaling settings. docs/multi-model.md says more.

Each extra model is a `both` pool of its own (`<svc>-<name>-both`), its pods labelled
`kvyard.io/pool: <name>` and served as `<name>`; with `models:` the primary pool's pods
are labelled `kvyard.io/pool: default`. An extra pool's selector is
{service, component, pool} and its pods carry no role label (the EPP reads a missing
role as `both`), so no two pools' Deployments select each other's pods, and the primary
Deployment's selector (immutable) never changes. Adapters are served by the pools of
their `model` (default: the primary) through vLLM's flags (`--enable-lora
--lora-modules NAME=PATH --max-loras N --max-lora-rank R`), each adapter from a path
already in the container, a PersistentVolumeClaim or an image volume mounted at
`/adapters/<name>`.

Tokenizers: the EPP keys precise prefix matches the way each pool's workers tokenize
(its models file's `tokenizer:` per model). An extra model whose weights the EPP pod can
read (the demo, a PersistentVolumeClaim, an image volume) gets its tokenizer written
there, its volume mounted read-only in the EPP pod at `/models-<name>`; precise routing
is on only where every model's tokenizer is readable (render_epp.precise_routing), so no
pool is ever keyed with another model's tokenizer.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from kvyard.common import wire

from . import render_common as rc
from .spec import PRIMARY_POOL, Adapter, ExtraModel, Pool, ServiceSpec, primary_name

ADAPTER_MOUNT = "/adapters"
EPP_READABLE = ("demo", "pvc", "image")   # model sources whose tokenizer the EPP pod can load
# vLLM's accepted --max-lora-rank values (vllm/config/lora.py)
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def _served_by(s: ServiceSpec, a: Adapter) -> bool:
    return (a.model or primary_name(s)) == primary_name(s)


def pool_adapters(s: ServiceSpec) -> list[Adapter]:
    """The adapters this spec's workers serve (an extra model's spec: that model's)."""
    return [a for a in s.adapters if _served_by(s, a)]


def _adapter_path(a: Adapter) -> str:
    if a.claim_name is None and a.image is None:
        return str(a.path)
    base = f"{ADAPTER_MOUNT}/{a.name}"
    return f"{base}/{a.path.strip('/')}" if a.path else base


def lora_args(s: ServiceSpec) -> list[str]:
    """vLLM's LoRA flags (kvyard's worker takes the same) for this spec's workers."""
    adapters = pool_adapters(s)
    if not adapters:
        return []
    rank = max(a.rank for a in adapters)
    return ["--enable-lora", "--lora-modules", *(f"{a.name}={_adapter_path(a)}" for a in adapters),
            "--max-loras", str(s.max_loras),
            "--max-lora-rank", str(next(r for r in LORA_RANKS if r >= rank))]


def adapter_volumes(s: ServiceSpec) -> tuple[list[dict], list[dict]]:
    vols, mounts = [], []
    for a in pool_adapters(s):
        if a.claim_name is not None:
            src: dict[str, Any] = {"persistentVolumeClaim": {"claimName": a.claim_name,
                                                             "readOnly": True}}
        elif a.image is not None:
            src = {"image": {"reference": a.image, "pullPolicy": a.image_pull_policy}}
        else:
            continue
        vols.append({"name": f"adapter-{a.name}", **src})
        mounts.append({"name": f"adapter-{a.name}", "mountPath": f"{ADAPTER_MOUNT}/{a.name}",
                       "readOnly": True})
    return vols, mounts


def extra_model_volume(s: ServiceSpec, m: ExtraModel) -> tuple[list[dict], list[dict], str]:
    """(volumes, mounts, tokenizer source) for an extra model's tokenizer in the EPP pod:
    its model volume, renamed and mounted read-only at /models-<name>."""
    vols, mounts, arg = rc.model_volume(replace(s, model=m.model))
    if not vols:
        return [], [], arg
    where = f"{rc.MODEL_MOUNT}-{m.name}"
    vols = [{**vols[0], "name": f"model-{m.name}"}]
    mounts = [{**mounts[0], "name": f"model-{m.name}", "mountPath": where}]
    return vols, mounts, where + arg[len(rc.MODEL_MOUNT):]


def models_table(s: ServiceSpec, tokenizers: bool = False) -> dict[str, Any] | None:
    """The EPP's --models-file (kvyard.epp.models); None: one model, no adapters.
    `tokenizers`: each extra model's tokenizer source as the EPP pod reads it."""
    if not s.models and not s.adapters:
        return None
    primary = primary_name(s)
    rows = [{"name": primary, "pool": PRIMARY_POOL if s.models else "",
             "adapters": [a.name for a in pool_adapters(s)]}]
    rows[0] = {k: v for k, v in rows[0].items() if v != ""}
    for m in s.models:
        row = {"name": m.name, "pool": m.name,
               "adapters": [a.name for a in s.adapters if a.model == m.name]}
        if tokenizers and m.model.source in EPP_READABLE:
            row["tokenizer"] = extra_model_volume(s, m)[2]
        rows.append(row)
    return {"models": rows}


def models_status(s: ServiceSpec) -> list[dict[str, Any]]:
    """status.models: each base model's pool and the adapters it serves."""
    table = models_table(s)
    if table is None:
        return []
    return [{"name": r["name"], "pool": r.get("pool", PRIMARY_POOL), "adapters": r["adapters"]}
            for r in table["models"]]


def _relabel(obj: dict[str, Any], s: ServiceSpec, pool: str) -> dict[str, Any]:
    """An extra model's pool: its own name and a selector on its pool label (no role)."""
    obj = copy.deepcopy(obj)
    md = obj["metadata"]
    role = md["labels"].get(wire.ROLE_LABEL, "both")
    md["name"] = f"{s.name}-{pool}-{role}"
    md["labels"][wire.POOL_LABEL] = pool
    sel = {wire.SERVICE_LABEL: s.name, wire.COMPONENT_LABEL: "worker", wire.POOL_LABEL: pool}
    if obj["kind"] == "Service":
        obj["spec"]["selector"] = sel
        return obj
    obj["spec"]["selector"] = {"matchLabels": sel}
    tmpl = obj["spec"]["template"]["metadata"]["labels"]
    tmpl.pop(wire.ROLE_LABEL, None)
    tmpl[wire.POOL_LABEL] = pool
    for c in obj["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
        c["labelSelector"] = {"matchLabels": dict(sel)}
    return obj


def label_primary(s: ServiceSpec, children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """With extra models the primary pool's pods say they are the default pool (a template
    label: the Deployment's selector stays as it was)."""
    if not s.models:
        return children
    for obj in children:
        if obj["kind"] == "Deployment":
            obj["spec"]["template"]["metadata"]["labels"][wire.POOL_LABEL] = PRIMARY_POOL
    return children


def render_model_pools(s: ServiceSpec, render_pool, keda: bool) -> list[dict[str, Any]]:
    """Every extra model's `both` pool (`render_pool(spec, pool, keda)` renders one)."""
    out = []
    for m in s.models:
        # fixed replicas: KEDA's ScaledObjects (render_scaling.py) scale the primary's pools
        sub = replace(s, model=m.model, models=[], autoscaling=False, scale_to_zero=False,
                      adapters=[a for a in s.adapters if a.model == m.name])
        for obj in render_pool(sub, Pool("both", m.replicas, m.replicas, m.replicas), keda):
            out.append(_relabel(obj, s, m.name))
    return out
