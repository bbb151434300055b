"""A ScaledObject's `scalerMetadata` (the trigger's `metadata`), parsed and checked.

Keys (all strings, as KEDA passes them):

| key | meaning | default |
|---|---|---|
| `pool` | the EPP's pool (`kvyard epp --pool-name`); another pool is NOT_FOUND | required |
| `role` | the worker pool this ScaledObject scales: `both`, `decode` or `prefill` | required |
| `targetValue` | replicas-worth of demand per replica (HPA: replicas = ceil(metric / target)); below 1 keeps headroom | `1` |
| `ttftMs` | the TTFT objective: a replica's prefill backlog should clear within it | EPP's `ttft_s` |
| `tpotMs` | the TPOT objective at which a replica's decode capacity is measured | EPP's `tpot_s` |
| `kvTarget` | KV-cache occupancy (0..1] one replica should run at | EPP's `kv_target` |
| `signal` | `predictive`: the larger of the backlog and the arrival forecast (`predictive.py`; the backlog alone where the EPP has no forecast, i.e. no latency scorer); `backlog`: the backlog only | `predictive` |
| `leadMs` | how far ahead the forecast looks: the pod start time | 60000 |

KEDA passes its own trigger keys along (`scalerAddress`, TLS settings); they are
ignored. Any other key is refused, so a misspelt `targetvalue` is an
INVALID_ARGUMENT instead of a silent default.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvyard.common.wire import ROLES

from .predictive import LEAD_S

KEDA_KEYS = frozenset({"scalerAddress", "enableTLS", "unsafeSsl", "caCert", "tlsCertFile",
                       "tlsClientCert", "tlsClientKey"})
KEYS = ("pool", "role", "targetValue", "ttftMs", "tpotMs", "kvTarget", "signal", "leadMs")
SIGNALS = ("predictive", "backlog")
# Demand.notify's wait roles → the ScaledObject roles a notification wakes. A request
# waiting for "decode" can be served by a `decode` or a `both` endpoint.
WAKES = {"decode": ("decode", "both"), "prefill": ("prefill",)}


class MetadataError(ValueError):
    """Bad scalerMetadata: the gRPC answer is INVALID_ARGUMENT with this message."""


@dataclass(slots=True, frozen=True)
class ScalerDefaults:
    """The EPP's objectives; a ScaledObject's metadata may override them."""

    ttft_s: float = 1.0
    tpot_s: float = 0.05
    kv_target: float = 0.8
    target_value: float = 1.0


@dataclass(slots=True, frozen=True)
class ScaledObjectParams:
    pool: str
    role: str
    target_value: float
    ttft_s: float
    tpot_s: float
    kv_target: float
    predictive: bool = True  # signal: the forecast joins the backlog (when the EPP has one)
    lead_s: float = LEAD_S

    @property
    def wait_role(self) -> str:
        """The Demand role whose held requests this ScaledObject serves."""
        return "prefill" if self.role == "prefill" else "decode"

    @property
    def metric_name(self) -> str:
        """KEDA prefixes `sN-` itself and strips it again in GetMetrics requests."""
        return re.sub(r"[^a-z0-9-]+", "-", f"kvyard-{self.pool}-{self.role}".lower())

    def metadata(self) -> dict[str, str]:
        """The metadata that selects exactly these parameters (what `kvyard status` shows)."""
        return {"pool": self.pool, "role": self.role, "targetValue": _num(self.target_value),
                "ttftMs": _num(self.ttft_s * 1000), "tpotMs": _num(self.tpot_s * 1000),
                "kvTarget": _num(self.kv_target),
                "signal": SIGNALS[0] if self.predictive else SIGNALS[1],
                "leadMs": _num(self.lead_s * 1000)}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _positive(meta: dict[str, str], key: str, default: float, hi: float = math.inf) -> float:
    raw = meta.get(key)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise MetadataError(f"scalerMetadata.{key}: {raw!r} is not a number") from None
    if not math.isfinite(v) or not 0.0 < v <= hi:
        bound = f"in (0, {hi:g}]" if hi != math.inf else "> 0"
        raise MetadataError(f"scalerMetadata.{key}: {raw!r} must be {bound}")
    return v


def parse_metadata(meta: dict[str, str], d: ScalerDefaults) -> ScaledObjectParams:
    unknown = sorted(k for k in meta if k not in KEYS and k not in KEDA_KEYS)
    if unknown:
        raise MetadataError(f"scalerMetadata: unknown key(s) {', '.join(unknown)} "
                            f"(kvyard reads {', '.join(KEYS)})")
    pool = meta.get("pool", "").strip()
    if not pool:
        raise MetadataError("scalerMetadata.pool is required (the EPP's --pool-name)")
    role = meta.get("role", "")
    if role not in ROLES:
        raise MetadataError(f"scalerMetadata.role: {role!r} must be one of {', '.join(ROLES)}")
    signal = meta.get("signal", SIGNALS[0])
    if signal not in SIGNALS:
        raise MetadataError(f"scalerMetadata.signal: {signal!r} must be one of "
                            f"{', '.join(SIGNALS)}")
    return ScaledObjectParams(
        pool=pool, role=role, target_value=_positive(meta, "targetValue", d.target_value),
        ttft_s=_positive(meta, "ttftMs", d.ttft_s * 1000) / 1000,
        tpot_s=_positive(meta, "tpotMs", d.tpot_s * 1000) / 1000,
        kv_target=_positive(meta, "kvTarget", d.kv_target, hi=1.0),
        predictive=signal == SIGNALS[0], lead_s=_positive(meta, "leadMs", LEAD_S * 1000) / 1000)
