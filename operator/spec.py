"""An InferenceService's spec as typed values, defaulted and checked.

The checks repeat the schema's (enums, bounds, CEL rules): an object stored before a
schema change, or sent to a server that does not validate, must still end as a
`Degraded: InvalidSpec` status with the reason, never as an exception in a loop.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from kvyard.common.models import DEMO_SERVED_NAME
from kvyard.common.wire import ROLES, WORKER_KV_PEER_PORT

from .crd import defaulted_spec
from .schema import DEVICES, ENGINES, MODEL_SOURCES, QUANTITY

PRIMARY_POOL = "default"  # the primary model's pool label when there are several models
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$"
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


class SpecError(ValueError):
    """A spec the operator cannot render; the message names the field."""


def quantity_bytes(text: str) -> int:
    m = re.match(QUANTITY, str(text))
    if not m:
        raise SpecError(f"not a size: {text!r} (e.g. 20Gi)")
    unit = re.sub(r"^[0-9.]+", "", text)
    return int(float(text[: len(text) - len(unit)]) * _UNITS[unit])


@dataclass(slots=True)
class EppTls:
    """TLS on every EPP's ext_proc and scaler (the chart's `tls`; render_tls.py). The
    certificate is a Secret (tls.crt, tls.key, ca.crt) in each service's namespace: the
    user's `secret_name`, or one cert-manager writes from `issuer` for a Certificate the
    operator renders per service. KEDA reads the CA (and its client certificate when
    `mutual`) through `trigger_auth`, a (Cluster)TriggerAuthentication the chart writes."""

    secret_name: str | None = None
    issuer: dict[str, str] | None = None   # cert-manager issuerRef: {name, kind, group}
    mutual: bool = False                   # the EPP asks for client certificates
    trigger_auth: dict[str, str] | None = None   # KEDA authenticationRef: {name, kind}


@dataclass(slots=True)
class Defaults:
    """What the operator's deployment decides for every service (the chart's values)."""

    image: str | None = None          # kvyard's image; None: ghcr.io/kvyard/kvyard:<version>
    pull_policy: str = "IfNotPresent"
    # kvyard workers on device cuda; None: `image` if given, else <repository>:<version>-cuda.
    cuda_image: str | None = None
    image_pull_secrets: list[str] = field(default_factory=list)  # on every pod it creates
    # The workers' and gateways' ServiceAccount (e.g. a cloud identity for model storage);
    # None: the namespace's default. The EPP keeps its own (it lists pods).
    service_account: str | None = None
    kv_peer_port: int = WORKER_KV_PEER_PORT   # P/D KV transfers; the chart's NetworkPolicy opens it
    cluster_domain: str = "cluster.local"     # for the fully qualified Service names it writes
    epp_tls: EppTls | None = None             # None: the EPP's gRPC ports are plaintext


@dataclass(slots=True)
class Pool:
    role: str
    min_replicas: int
    max_replicas: int
    replicas: int


@dataclass(slots=True)
class Download:
    """source download: a Hub repository, fetched into the pod by an init container."""

    repo: str
    revision: str = "main"
    allow_patterns: list[str] = field(default_factory=list)
    token_secret: str | None = None
    token_key: str = "token"
    size: str = "50Gi"
    storage_class: str | None = None
    endpoint: str | None = None


@dataclass(slots=True)
class Model:
    source: str
    path: str | None
    claim_name: str | None
    image: str | None
    image_pull_policy: str
    served_name: str | None
    download: Download | None = None


@dataclass(slots=True)
class Adapter:
    name: str
    rank: int
    model: str | None          # the base model's name; None: the primary model
    path: str | None = None    # in the container, or inside the PVC / image
    claim_name: str | None = None
    image: str | None = None
    image_pull_policy: str = "IfNotPresent"


@dataclass(slots=True)
class ExtraModel:
    name: str
    model: Model
    replicas: int


@dataclass(slots=True)
class Engine:
    name: str
    device: str
    image: str | None
    resources: dict[str, Any]
    max_model_len: int | None
    block_size: int
    kv_cache_memory: str | None
    extra_args: list[str]
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)
    priority_class: str | None = None
    startup_seconds: int = 600
    shm_size: str | None = None


@dataclass(slots=True)
class KVStore:
    dram_gb: float = 0.0
    ssd_bytes: int = 0
    ssd_path: str | None = None
    ssd_medium: str = ""
    ssd_storage_class: str | None = None
    redis_url: str | None = None
    redis_secret: str | None = None
    redis_secret_key: str = "password"


@dataclass(slots=True)
class Routing:
    prefix_cache: float
    queue: float
    kv_cache_utilization: float
    non_cached_tokens: int
    prompt_tokens: int
    destination_fallbacks: int
    lora_affinity: float = 4.0


@dataclass(slots=True)
class ServiceSpec:
    """Everything the renderers read; `raw` is the defaulted spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    model: Model
    engine: Engine
    pools: list[Pool]
    routing: Routing
    kvstore: KVStore | None
    scale_to_zero: bool
    idle_seconds: int
    inference_pool: bool
    cold_start_seconds: int = 300
    autoscaling: bool = False
    gateway_replicas: int = 2
    epp_replicas: int = 1  # active-active EPPs (kvyard.epp.replicas)
    slo: dict[str, int] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    defaults: Defaults = field(default_factory=Defaults)
    # Several base models and LoRA adapters (operator/models.py renders them).
    models: list[ExtraModel] = field(default_factory=list)
    adapters: list[Adapter] = field(default_factory=list)
    max_loras: int = 4

    @property
    def autoscaled(self) -> bool:
        """KEDA owns the pools' replica counts (a ScaledObject per pool)."""
        return self.autoscaling or self.scale_to_zero

    @property
    def disaggregated(self) -> bool:
        return any(p.role == "prefill" for p in self.pools)


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise SpecError(message)


def _int(v: Any, where: str, lo: int, hi: int | None = None) -> int:
    _need(isinstance(v, int) and not isinstance(v, bool), f"{where}: want an integer, not {v!r}")
    _need(v >= lo and (hi is None or v <= hi), f"{where}: {v} is outside [{lo}, {hi or '∞'}]")
    return v


def _pools(raw: dict[str, Any], scale_to_zero: bool) -> list[Pool]:
    _need(isinstance(raw, dict), "spec.pools: want an object")
    unknown = set(raw) - set(ROLES)
    _need(not unknown, f"spec.pools: unknown role(s) {sorted(unknown)}; roles are {list(ROLES)}")
    pools = []
    for role in ROLES:
        if role not in raw:
            continue
        p, where = raw[role] or {}, f"spec.pools.{role}"
        lo = _int(p.get("minReplicas", 1), f"{where}.minReplicas", 0, 1000)
        hi = _int(p.get("maxReplicas", 1), f"{where}.maxReplicas", 1, 1000)
        _need(lo <= hi, f"{where}: minReplicas {lo} > maxReplicas {hi}")
        n = _int(p.get("replicas", lo), f"{where}.replicas", 0, 1000)
        _need(lo <= n <= hi, f"{where}.replicas {n} is outside [{lo}, {hi}]")
        _need(lo >= 1 or scale_to_zero, f"{where}.minReplicas 0 needs scaleToZero.enabled")
        pools.append(Pool(role, lo, hi, n))
    roles = {p.role for p in pools}
    _need(bool(roles & {"both", "decode"}), "spec.pools: a decode or both pool is needed")
    return pools


def _model(m: dict[str, Any]) -> Model:
    src = m.get("source")
    _need(src in MODEL_SOURCES, f"spec.model.source {src!r}: want one of {list(MODEL_SOURCES)}")
    path = m.get("path")
    if src == "pvc":
        _need(bool((m.get("pvc") or {}).get("claimName")) and bool(path),
              "spec.model: source pvc needs pvc.claimName and path")
    if src == "image":
        _need(bool((m.get("image") or {}).get("reference")),
              "spec.model: source image needs image.reference")
    if src in ("hf", "gguf"):
        _need(bool(path), f"spec.model: source {src} needs path")
    if src == "gguf":
        _need(str(path).endswith(".gguf"), "spec.model: source gguf needs a .gguf path")
    img = m.get("image") or {}
    return Model(src, path, (m.get("pvc") or {}).get("claimName"), img.get("reference"),
                 img.get("pullPolicy", "IfNotPresent"), m.get("servedModelName"),
                 _download(m.get("download")) if src == "download" else None)


def _download(d: dict[str, Any] | None) -> Download:
    d = d or {}
    _need(bool(re.match(r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[-A-Za-z0-9_.]+$", str(d.get("repo", "")))),
          f"spec.model.download.repo {d.get('repo')!r}: want a Hub id like org/name")
    size = str(d.get("size", "50Gi"))
    quantity_bytes(size)
    ref = d.get("tokenSecretRef") or {}
    return Download(d["repo"], str(d.get("revision", "main")), list(d.get("allowPatterns") or []),
                    ref.get("name"), ref.get("key", "token"), size, d.get("storageClassName"),
                    d.get("endpoint"))


def _engine(e: dict[str, Any]) -> Engine:
    _need(e.get("name") in ENGINES, f"spec.engine.name {e.get('name')!r}: unknown engine; "
                                    f"want one of {list(ENGINES)}")
    _need(e.get("device") in DEVICES, f"spec.engine.device {e.get('device')!r}: want one of "
                                      f"{list(DEVICES)}")
    for size in (e.get("kvCacheMemory"), e.get("shmSize")):
        if size is not None:
            quantity_bytes(size)
    extra = e.get("extraArgs") or []
    _need(all(isinstance(a, str) for a in extra), "spec.engine.extraArgs: want strings")
    return Engine(e["name"], e["device"], e.get("image"), dict(e.get("resources") or {}),
                  e.get("maxModelLen"), _int(e.get("blockSize", 16), "spec.engine.blockSize", 1,
                                             1024), e.get("kvCacheMemory"), list(extra),
                  dict(e.get("nodeSelector") or {}), list(e.get("tolerations") or []),
                  dict(e.get("affinity") or {}), e.get("priorityClassName"),
                  _int(e.get("startupSeconds", 600), "spec.engine.startupSeconds", 60, 7200),
                  e.get("shmSize"))


def _kvstore(k: dict[str, Any] | None) -> KVStore | None:
    if k is None:
        return None
    ssd, redis = k.get("ssd") or {}, k.get("redis") or {}
    out = KVStore(dram_gb=float(k.get("dramGB", 1)))
    _need(out.dram_gb >= 0, "spec.kvstore.dramGB: must be >= 0")
    if ssd:
        out.ssd_bytes, out.ssd_path = quantity_bytes(ssd.get("size", "")), ssd.get("path")
        out.ssd_medium, out.ssd_storage_class = ssd.get("medium", ""), ssd.get("storageClassName")
        _need(out.ssd_medium in ("", "Memory"), "spec.kvstore.ssd.medium: '' or Memory")
        _need(not (out.ssd_path and out.ssd_storage_class),
              "spec.kvstore.ssd: path (hostPath) or storageClassName, not both")
    if redis:
        _need(bool(re.match(r"^redis(\+cluster|s)?://.+", str(redis.get("url", "")))),
              f"spec.kvstore.redis.url {redis.get('url')!r}: want redis://host:port")
        out.redis_url = redis["url"]
        ref = redis.get("secretRef") or {}
        out.redis_secret, out.redis_secret_key = ref.get("name"), ref.get("key", "password")
    return out


def primary_name(s: ServiceSpec) -> str | None:
    """The name clients send for the primary model, when the operator knows it."""
    if s.model.served_name:
        return s.model.served_name
    return DEMO_SERVED_NAME if s.model.source == "demo" else None


def parse_adapters(raw: list[dict[str, Any]] | None) -> list[Adapter]:
    out = []
    for i, a in enumerate(raw or []):
        where = f"spec.adapters[{i}]"
        name = a.get("name")
        if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
            raise SpecError(f"{where}.name {name!r}: want a DNS label of at most 40 characters")
        src = a.get("source") or {}
        pvc, img = src.get("pvc") or {}, src.get("image") or {}
        if sum(bool(x) for x in (pvc, img)) > 1 or not (pvc or img or src.get("path")):
            raise SpecError(f"{where}.source: a path, or pvc.claimName (and path), or "
                            "image.reference")
        rank = a.get("rank", 16)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 512:
            raise SpecError(f"{where}.rank {rank!r}: want 1..512")
        out.append(Adapter(name, rank, a.get("model"), src.get("path"), pvc.get("claimName"),
                           img.get("reference"), img.get("pullPolicy", "IfNotPresent")))
    return out


def parse_models(raw: list[dict[str, Any]] | None, model_of) -> list[ExtraModel]:
    """`model_of` parses a model object as spec.model's (spec._model)."""
    out = []
    for i, m in enumerate(raw or []):
        where = f"spec.models[{i}]"
        name = m.get("name")
        if not isinstance(name, str) or not re.match(NAME_PATTERN, name) or name == PRIMARY_POOL:
            raise SpecError(f"{where}.name {name!r}: want a DNS label of at most 40 characters, "
                            f"not {PRIMARY_POOL!r}")
        n = m.get("replicas", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1000:
            raise SpecError(f"{where}.replicas {n!r}: want 1..1000")
        try:
            model = model_of({"source": "demo", **(m.get("model") or {})})
        except SpecError as e:
            raise SpecError(f"{where}: {e}") from None
        out.append(ExtraModel(name, replace(model, served_name=name), n))
    return out


def check_models(s: ServiceSpec) -> None:
    """Rules across fields: unique names, adapters naming a served model, a known primary
    name where one EPP routes several names."""
    names = [m.name for m in s.models] + [a.name for a in s.adapters]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise SpecError(f"spec: {dup!r} names two models or adapters")
    if (s.models or s.adapters) and primary_name(s) is None:
        raise SpecError("spec.model.servedModelName: needed with models or adapters (the EPP "
                        "routes by name)")
    bases = {m.name for m in s.models} | {primary_name(s)}
    for a in s.adapters:
        if a.model is not None and a.model not in bases:
            raise SpecError(f"spec.adapters: {a.name!r} names model {a.model!r}, which is not "
                            f"served here ({sorted(b for b in bases if b)})")
    if s.models and s.engine.name == "kvyard" and s.disaggregated:
        raise SpecError("spec.models: extra models are both pools; not with a prefill pool")


def parse(body: dict[str, Any], defaults: Defaults | None = None) -> ServiceSpec:
    """The custom resource (as the API returns it) -> a ServiceSpec, or SpecError."""
    meta = body.get("metadata") or {}
    raw = defaulted_spec(body.get("spec"))
    stz = raw["scaleToZero"]
    engine = _engine(raw["engine"])
    model = _model(raw["model"])
    pools = _pools(raw["pools"], bool(stz.get("enabled")))
    kvstore = _kvstore(raw.get("kvstore"))
    if engine.name == "vllm":
        _need(model.source != "demo", "spec: engine vllm cannot serve the demo model")
        _need(kvstore is None, "spec.kvstore: engine vllm has no kvstore")
        _need(all(p.role != "prefill" for p in pools), "spec.pools.prefill needs engine kvyard")
    r, pd = raw["routing"], raw["routing"]["pd"]
    sc = r["scorers"]
    routing = Routing(float(sc["prefixCache"]), float(sc["queue"]),
                      float(sc["kvCacheUtilization"]),
                      _int(pd["nonCachedTokens"], "spec.routing.pd.nonCachedTokens", 0),
                      _int(pd["promptTokens"], "spec.routing.pd.promptTokens", 0),
                      _int(r["destinationFallbacks"], "spec.routing.destinationFallbacks", 0, 15))
    routing.lora_affinity = float(sc.get("loraAffinity", 4))
    _need(min(routing.prefix_cache, routing.queue, routing.kv_cache_utilization,
              routing.lora_affinity) >= 0,
          "spec.routing.scorers: weights must be >= 0")
    out = ServiceSpec(
        name=meta.get("name", ""), namespace=meta.get("namespace") or "default",
        uid=meta.get("uid", ""), generation=int(meta.get("generation") or 1), model=model,
        engine=engine, pools=pools, routing=routing, kvstore=kvstore,
        scale_to_zero=bool(stz.get("enabled")), idle_seconds=int(stz.get("idleSeconds", 300)),
        cold_start_seconds=_int(stz.get("coldStartSeconds", 300),
                                "spec.scaleToZero.coldStartSeconds", 1, 900),
        autoscaling=bool((raw.get("autoscaling") or {}).get("enabled")),
        inference_pool=bool(raw["inferencePool"].get("enabled")),
        gateway_replicas=_int(raw["gateway"].get("replicas", 2), "spec.gateway.replicas", 1, 100),
        epp_replicas=_int((raw.get("epp") or {}).get("replicas", 1), "spec.epp.replicas", 1, 16),
        slo=dict(raw.get("slo") or {}), raw=raw, defaults=defaults or Defaults(),
        models=parse_models(raw.get("models"), _model),
        adapters=parse_adapters(raw.get("adapters")),
        max_loras=_int(raw["engine"].get("maxLoras", 4), "spec.engine.maxLoras", 1, 256))
    check_models(out)
    return out
