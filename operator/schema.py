"""The InferenceService schema: the one source of truth for the CRD's openAPIV3Schema.

The API server applies its defaults and checks its bounds and CEL rules, so a bad
spec is refused at `kubectl apply`. The operator applies the same defaults
(`crd.apply_defaults`) and `spec.py` re-checks the same rules, because an object
can predate a schema change and test servers do not validate.
"""
from __future__ import annotations

from typing import Any

from kvyard.common.wire import ROLES

ENGINES = ("kvyard", "vllm")
DEVICES = ("cpu", "cuda")
MODEL_SOURCES = ("demo", "pvc", "hf", "gguf", "image", "download")
QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"
CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


def _str(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **kw}


def _int(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "integer", "description": desc, **kw}


def _obj(desc: str, props: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "object", "description": desc, "properties": props, **kw}


def _pool(role: str) -> dict[str, Any]:
    return _obj(f"The {role} pool (omit it for none).", {
        "minReplicas": _int("Fewest replicas an autoscaler may set (0 needs scaleToZero).",
                            minimum=0, maximum=1000, default=1),
        "maxReplicas": _int("Most replicas an autoscaler may set.", minimum=1, maximum=1000,
                            default=1),
        "replicas": _int("Replicas without an autoscaler (default: minReplicas).",
                         minimum=0, maximum=1000),
    }, **{"x-kubernetes-validations": [
        {"rule": "self.minReplicas <= self.maxReplicas",
         "message": "minReplicas must be <= maxReplicas"},
        {"rule": "!has(self.replicas) || "
                 "(self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas)",
         "message": "replicas must lie within [minReplicas, maxReplicas]"},
    ]})


_QUANTITY_MAP = {"type": "object", "additionalProperties": {
    "anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}}

MODEL = _obj("Where the weights come from.", {
    "source": _str("demo: SmolLM2-135M baked into the CPU image; pvc: a path on a "
                   "PersistentVolumeClaim; hf / gguf: a Hugging Face directory / a .gguf file "
                   "at a path in the image; image: an OCI image mounted as a volume; download: "
                   "a Hugging Face Hub repository fetched by an init container at each start.",
                   enum=list(MODEL_SOURCES), default="demo"),
    "path": _str("pvc / image: the file or directory inside the volume; hf / gguf: the path "
                 "in the container.", maxLength=1024),
    "pvc": _obj("The claim for source pvc (ReadOnlyMany for more than one pod).", {
        "claimName": _str("PersistentVolumeClaim name.", minLength=1, maxLength=253),
    }, required=["claimName"]),
    "image": _obj("The OCI image for source image (Kubernetes ImageVolume).", {
        "reference": _str("Image reference.", minLength=1),
        "pullPolicy": _str("Pull policy.", enum=["Always", "IfNotPresent", "Never"],
                           default="IfNotPresent"),
    }, required=["reference"]),
    "download": _obj("For source download: what the init container fetches into the pod.", {
        "repo": _str("Hub repository id, e.g. meta-llama/Meta-Llama-3-8B-Instruct.",
                     pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[-A-Za-z0-9_.]+$", maxLength=200),
        "revision": _str("Branch, tag or commit.", default="main", maxLength=200),
        "allowPatterns": {"type": "array", "maxItems": 32, "items": {"type": "string"},
                          "description": "Only files matching these globs (default: all)."},
        "tokenSecretRef": _obj("The Secret key holding a Hub token (gated models).", {
            "name": _str("Secret name.", minLength=1),
            "key": _str("Key in the Secret.", minLength=1, default="token"),
        }, required=["name"]),
        "size": _str("The volume's size limit, e.g. 40Gi.", pattern=QUANTITY, default="50Gi"),
        "storageClassName": _str("A generic ephemeral volume of this StorageClass instead of "
                                 "an emptyDir.", minLength=1, maxLength=253),
        "endpoint": _str("A Hub mirror's URL (HF_ENDPOINT).", pattern=r"^https?://.+"),
    }, required=["repo"]),
    "servedModelName": _str("Name clients send as `model` (default: the model's own).",
                            maxLength=256),
}, default={}, **{"x-kubernetes-validations": [
    {"rule": "self.source != 'download' || has(self.download)",
     "message": "source download needs download.repo"},
    {"rule": "self.source != 'pvc' || (has(self.pvc) && has(self.path))",
     "message": "source pvc needs pvc.claimName and path"},
    {"rule": "self.source != 'image' || has(self.image)",
     "message": "source image needs image.reference"},
    {"rule": "!(self.source in ['hf', 'gguf']) || has(self.path)",
     "message": "source hf or gguf needs path"},
    {"rule": "self.source != 'gguf' || (has(self.path) && self.path.endsWith('.gguf'))",
     "message": "source gguf needs a path ending in .gguf"},
]})

ENGINE = _obj("The model server every pool runs.", {
    "name": _str("kvyard workers, or stock vLLM pods (the EPP speaks the vLLM protocol).",
                 enum=list(ENGINES), default="kvyard"),
    "device": _str("cpu or cuda.", enum=list(DEVICES), default="cpu"),
    "image": _str("Container image (default: ghcr.io/kvyard/kvyard:<version>, or "
                  "vllm/vllm-openai for engine vllm)."),
    "resources": _obj("Container resources (default per device).", {
        "requests": _QUANTITY_MAP, "limits": _QUANTITY_MAP}),
    "maxModelLen": _int("Context length (default: the model's).", minimum=16,
                        maximum=10_000_000),
    "blockSize": _int("KV block size in tokens.", enum=[8, 16, 32, 64, 128], default=16),
    "kvCacheMemory": _str("KV-cache capacity per worker, e.g. 2Gi.", pattern=QUANTITY),
    "extraArgs": {"type": "array", "items": {"type": "string"}, "maxItems": 64,
                  "description": "More flags for the model server, appended as given."},
    "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"},
                     "description": "Worker pods' node selector (e.g. GPU nodes)."},
    "tolerations": {"type": "array", "maxItems": 32, "description": "Worker pods' tolerations.",
                    "items": _obj("A toleration.", {
                        "key": _str("Taint key."),
                        "operator": _str("Exists or Equal.", enum=["Exists", "Equal"]),
                        "value": _str("Taint value."),
                        "effect": _str("Taint effect.",
                                       enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
                        "tolerationSeconds": _int("For NoExecute."),
                    })},
    "affinity": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "description": "Worker pods' affinity (a core/v1 Affinity), e.g. GPU models."},
    "priorityClassName": _str("Worker pods' PriorityClass.", maxLength=253),
    "startupSeconds": _int("How long a worker may take to start (image pull aside: model load, "
                           "kernel compilation) before the kubelet restarts it.", minimum=60,
                           maximum=7200, default=600),
    "maxLoras": _int("LoRA adapters active at once per worker (vLLM's --max-loras), with "
                     "spec.adapters.", minimum=1, maximum=256, default=4),
    "shmSize": _str("Size of the workers' /dev/shm (a memory-backed emptyDir; it counts against "
                    "the memory limit). Default: 2Gi on device cuda, none on cpu.",
                    pattern=QUANTITY),
}, default={})

ROUTING = _obj("How the EPP scores workers.", {
    "scorers": _obj("Scorer weights (0 turns one off).", {
        "prefixCache": {"type": "number", "minimum": 0, "maximum": 100, "default": 3},
        "queue": {"type": "number", "minimum": 0, "maximum": 100, "default": 2},
        "kvCacheUtilization": {"type": "number", "minimum": 0, "maximum": 100, "default": 2},
        "loraAffinity": {"type": "number", "minimum": 0, "maximum": 100, "default": 4,
                         "description": "With spec.adapters: prefer workers with the "
                                        "request's adapter active, then a free slot."},
    }, default={}),
    "pd": _obj("Prefill/decode split (used when there is a prefill pool).", {
        "nonCachedTokens": _int("Disaggregate when this many prompt tokens are not cached "
                                "on the decode pick.", minimum=0, default=256),
        "promptTokens": _int("... and the prompt has at least this many.", minimum=0,
                             default=0),
    }, default={}),
    "destinationFallbacks": _int("Endpoints listed after each pick for the gateway's "
                                 "retries.", minimum=0, maximum=15, default=2),
}, default={})

KVSTORE = _obj("The workers' KV-block store (engine kvyard only).", {
    "dramGB": {"type": "number", "minimum": 0, "maximum": 4096, "default": 1,
               "description": "In-process DRAM tier per worker, GB (10^9 bytes)."},
    "ssd": _obj("An SSD tier: an emptyDir per pod (size-limited) unless told otherwise.", {
        "size": _str("Capacity, e.g. 20Gi.", pattern=QUANTITY),
        "medium": _str("The emptyDir's medium: '' (the node's disk) or Memory.",
                       enum=["", "Memory"], default=""),
        "storageClassName": _str("A generic ephemeral volume of this StorageClass (a PVC per "
                                 "pod, deleted with it) instead of the emptyDir.",
                                 minLength=1, maxLength=253),
        "path": _str("A node directory (hostPath, shared by the node's workers): an explicit "
                     "choice, refused by Pod Security 'baseline'; an init container makes it "
                     "the workers' own (uid 65532) at each start.", pattern=r"^/.*"),
    }, required=["size"], **{"x-kubernetes-validations": [
        {"rule": "!(has(self.path) && has(self.storageClassName))",
         "message": "ssd: path (hostPath) or storageClassName (ephemeral volume), not both"},
    ]}),
    "redis": _obj("The pool-wide Redis tier.", {
        "url": _str("redis://host:port[/db] or redis+cluster://host:port.",
                    pattern=r"^redis(\+cluster|s)?://.+"),
        "secretRef": _obj("The Secret key holding the password.", {
            "name": _str("Secret name.", minLength=1),
            "key": _str("Key in the Secret.", minLength=1, default="password"),
        }, required=["name"]),
    }, required=["url"]),
})

SLO = _obj("Latency targets (for autoscaling; recorded, not enforced).", {
    "ttftMs": _int("Time to first token, ms.", minimum=1),
    "tpotMs": _int("Time per output token, ms.", minimum=1),
})

_DNS_NAME = r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$"
MODELS = {"type": "array", "maxItems": 16, "description": (
    "More base models behind the same gateway and EPP: each a `both` pool of its own "
    "(`<name>-<model>-both`), served as `name`; requests go to the pool of their `model`. "
    "The primary model (spec.model) then needs servedModelName unless it is the demo."),
    "items": _obj("One more base model.", {
        "name": _str("The name clients send as `model`; also the pool's name.",
                     pattern=_DNS_NAME, maxLength=40),
        "model": {k: v for k, v in MODEL.items() if k != "default"},
        "replicas": _int("Workers in its pool.", minimum=1, maximum=1000, default=1),
    }, required=["name"], **{"x-kubernetes-validations": [
        {"rule": "self.name != 'default'", "message": "'default' is the primary pool's name"}]}),
    "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}
ADAPTERS = {"type": "array", "maxItems": 256, "description": (
    "LoRA adapters (PEFT format) the workers of their model serve; a request names one as "
    "its `model`. Rendered as vLLM's --enable-lora --lora-modules --max-loras --max-lora-rank."),
    "items": _obj("One adapter.", {
        "name": _str("The name clients send as `model`.", pattern=_DNS_NAME, maxLength=40),
        "model": _str("The base model that serves it: a spec.models name or the primary's "
                      "served name (default: the primary).", maxLength=256),
        "rank": _int("Its LoRA rank (sets --max-lora-rank).", minimum=1, maximum=512,
                     default=16),
        "source": _obj("Where it is: a path in the container, a PVC, or an image volume "
                       "(mounted at /adapters/<name>; path is then inside it).", {
            "path": _str("A directory with adapter_config.json.", maxLength=1024),
            # the same shapes as spec.model's
            "pvc": MODEL["properties"]["pvc"],
            "image": MODEL["properties"]["image"],
        }, **{"x-kubernetes-validations": [
            {"rule": "has(self.path) || has(self.pvc) || has(self.image)",
             "message": "an adapter needs a path, a pvc or an image"},
            {"rule": "!(has(self.pvc) && has(self.image))",
             "message": "pvc or image, not both"}]}),
    }, required=["name", "source"]),
    "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}

SPEC = _obj("An inference service: model, engine, pools, routing, KV store.", {
    "model": MODEL,
    "models": MODELS,
    "adapters": ADAPTERS,
    "engine": ENGINE,
    "pools": _obj("Worker pools by role.", {role: _pool(role) for role in ROLES},
                  default={"both": {}}, **{"x-kubernetes-validations": [
                      {"rule": "has(self.both) || has(self.decode)",
                       "message": "a decode or both pool is needed to serve requests"},
                      {"rule": "!has(self.prefill) || has(self.decode) || has(self.both)",
                       "message": "a prefill pool needs a decode or both pool"},
                  ]}),
    "routing": ROUTING,
    "kvstore": KVSTORE,
    "slo": SLO,
    "autoscaling": _obj("KEDA scales every pool between minReplicas and maxReplicas on the "
                        "EPP's demand (one ScaledObject per pool, fed by the EPP's external "
                        "scaler); scaleToZero.enabled turns it on too. Off: pools run at "
                        "`replicas`.", {
        "enabled": {"type": "boolean", "default": False},
    }, default={}),
    "scaleToZero": _obj("Let the autoscaler take pools to zero (KEDA wakes them).", {
        "enabled": {"type": "boolean", "default": False},
        "idleSeconds": _int("Idle time before the step to zero.", minimum=30, default=300),
        "coldStartSeconds": _int("How long the EPP holds a request while no endpoint is ready "
                                 "(a wake from zero: pod start, image pull, model load) "
                                 "before a 503; the gateway holds at most 900 s.",
                                 minimum=1, maximum=900, default=300),
    }, default={}),
    "epp": _obj("kvyard's endpoint picker.", {
        "replicas": _int("Active-active EPP replicas: each sees every pod, they share their "
                         "picks over a pub/sub among them (a headless Service), and the "
                         "gateways balance ext_proc streams over them, retrying a failed "
                         "stream on another. 1: a single EPP.", minimum=1, maximum=16,
                         default=1),
    }, default={}),
    "gateway": _obj("kvyard's Envoy gateway.", {
        "replicas": _int("Gateway replicas (stateless; spread over nodes).", minimum=1,
                         maximum=100, default=2),
    }, default={}),
    "inferencePool": _obj("Also create a GAIE InferencePool pointing at the EPP.", {
        "enabled": {"type": "boolean", "default": False},
    }, default={}),
}, **{"x-kubernetes-validations": [
    {"rule": "self.engine.name == 'kvyard' || self.model.source != 'demo'",
     "message": "engine vllm cannot serve the demo model (a GGUF inside the kvyard image)"},
    {"rule": "self.engine.name == 'kvyard' || !has(self.kvstore)",
     "message": "kvstore is kvyard's; engine vllm has none"},
    {"rule": "self.engine.name == 'kvyard' || !has(self.pools.prefill)",
     "message": "a prefill pool needs engine kvyard"},
    {"rule": "self.scaleToZero.enabled || ("
             + " && ".join(f"(!has(self.pools.{r}) || self.pools.{r}.minReplicas >= 1)"
                           for r in ROLES) + ")",
     "message": "minReplicas 0 needs scaleToZero.enabled"},
]})

_CONDITION = _obj("A condition (Ready, Progressing, Degraded).", {
    "type": _str("Condition type.", enum=list(CONDITION_TYPES)),
    "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
    "reason": _str("CamelCase reason."),
    "message": _str("Human-readable detail."),
    "observedGeneration": _int("Generation the condition describes."),
    "lastTransitionTime": _str("When status last changed.", format="date-time"),
}, required=["type", "status"])

STATUS = _obj("What the operator observed.", {
    "observedGeneration": _int("Generation of the spec the children were rendered from."),
    "conditions": {"type": "array", "items": _CONDITION, "x-kubernetes-list-type": "map",
                   "x-kubernetes-list-map-keys": ["type"]},
    "pools": {"type": "object", "description": "Replicas per pool role.",
              "additionalProperties": _obj("One pool.", {
                  "replicas": _int("Desired."), "readyReplicas": _int("Ready."),
                  "updatedReplicas": _int("On the current template.")})},
    "gatewayAddress": _str("host:port clients send requests to."),
    "models": {"type": "array", "description": "Each base model's pool and the LoRA adapters "
                                               "it serves.",
               "items": _obj("One base model.", {
                   "name": _str("Its served name."), "pool": _str("Its pool label."),
                   "adapters": {"type": "array", "items": {"type": "string"}}})},
    # kopf's own bookkeeping lands here on older objects; never read by kvyard.
    "kopf": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
})

OPENAPI_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": SPEC,
        "status": STATUS,
    },
    "required": ["spec"],
}
