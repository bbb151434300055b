"""`python -m kvyard.bench.slo_fit TRACE...`: the latency models compared offline on the
EPP's traces (the latency scorer's `traceFile`: one line per followed request, the state
it was routed in and its outcome).

Each trace is replayed in time order as the EPP lives it: a request is predicted at its
routing time, and a model learns an outcome only once it has happened (TTFT at the
first token, TPOT at the end), so every error is on a held-out request. Errors are
those of the second half of each trace (the first warms the models up). Rows: the
shipped model (`PoolModels`, relative-error RLS on `features.py`), the same on the
plain feature set, per-endpoint vs pooled, absolute vs relative error, and, where
LightGBM is installed, gradient-boosted trees fitted on the first half (a batch fit:
more than an online model gets) with a p90 quantile objective.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path
from typing import Callable

from kvyard.epp.pool.endpoints import Endpoint
from kvyard.epp.slo.features import EndpointLoad, tpot_features, ttft_features
from kvyard.epp.slo.models import PoolModels
from kvyard.epp.slo.predictor import TPOT_FORGET, TTFT_FORGET

Features = Callable[[dict], list[float]]


def _state(r: dict) -> tuple[Endpoint, EndpointLoad]:
    ep = Endpoint(r["address"], waiting=r["waiting"], running=r["running"], kv_usage=r["kv"],
                  prompt_tokens_pending=r["ptp"], pending=r["pending"])
    ld = EndpointLoad(r["l_prefill"], r["l_prefilling"], r["l_decoding"], r["l_decode_tokens"],
                      r["l_rate"], r["t0"])
    return ep, ld


def shipped_ttft(r: dict) -> list[float]:
    ep, ld = _state(r)
    return ttft_features(ep, ld, r["uncached"], r["t0"])


def shipped_tpot(r: dict) -> list[float]:
    ep, ld = _state(r)
    return tpot_features(ep, ld, r["t0"], r["pred_out"])


def plain_ttft(r: dict) -> list[float]:
    """The first feature set: scraped queue and KV use, the EPP's prefill and decodes."""
    return [1.0, r["uncached"] / 1000, r["waiting"] + r["pending"], r["running"], r["kv"],
            r["l_prefill"] / 1000, float(r["l_decoding"])]


def plain_tpot(r: dict) -> list[float]:
    return [1.0, r["running"], r["waiting"] + r["pending"], r["kv"], r["l_prefill"] / 1000,
            r["l_decode_tokens"] / 1000, r["l_rate"] / 1000]


FEATURES: dict[str, dict[str, Features]] = {
    "ttft": {"shipped": shipped_ttft, "plain": plain_ttft},
    "tpot": {"shipped": shipped_tpot, "plain": plain_tpot},
}
FORGET = {"ttft": TTFT_FORGET, "tpot": TPOT_FORGET}


def _end(r: dict, kind: str) -> float:
    t = r["t0"] + r["ttft"]
    return t if kind == "ttft" else t + r["tpot"] * (r["out"] - 1)


MODES = {"per endpoint": "an endpoint's own model once it has 20 outcomes",
         "pooled": "the role's model only",
         "pooled+own": "the role's, or the endpoint's own where it predicts it better (shipped)"}


def replay(rs: list[dict], kind: str, fx: Features, mode: str = "pooled+own",
           relative: bool = True) -> list[tuple[float, float] | None]:
    """(mean, p90) predicted for each request before any outcome after its routing."""
    models = PoolModels(len(fx(rs[0])), FORGET[kind], relative=relative)
    events = [(r["t0"], 1, i) for i, r in enumerate(rs)]
    events += [(_end(r, kind), 0, i) for i, r in enumerate(rs) if r.get(kind)]
    out: list[tuple[float, float] | None] = [None] * len(rs)
    for _, is_route, i in sorted(events):
        r, x = rs[i], fx(rs[i])
        if not is_route:
            models.learn(r["address"], "both", x, r[kind])
            continue
        own = models.own.get(r["address"])
        if mode == "pooled+own":
            m = models.model(r["address"], "both")
        elif mode == "per endpoint" and own is not None and own.model.samples >= 20:
            m = own.model
        else:
            m = models.pooled_model("both")
        out[i] = m.predict(x)
    return out


def errors(preds, rs: list[dict], kind: str) -> tuple[float, float, int]:
    half = len(rs) // 2
    pairs = [(p, r[kind]) for p, r in list(zip(preds, rs))[half:] if p and r.get(kind)]
    if not pairs:
        return math.nan, math.nan, 0
    mape = sum(abs(p[0] - y) / y for p, y in pairs) / len(pairs)
    cov = sum(y <= p[1] for p, y in pairs) / len(pairs)
    return mape, cov, len(pairs)


def trees(rs: list[dict], kind: str, fx: Features):
    """Trees fitted on the first half: (mean by L1, p90 by the quantile loss) per request."""
    import lightgbm as lgb  # offline only: not a dependency of the EPP
    import numpy as np

    half = len(rs) // 2
    x = np.array([fx(r) for r in rs])
    train = [i for i in range(half) if rs[i].get(kind)]
    y = np.array([rs[i][kind] for i in train])
    p = dict(verbose=-1, learning_rate=0.05, num_leaves=15, min_data_in_leaf=10)
    mean = lgb.train({**p, "objective": "regression_l1"}, lgb.Dataset(x[train], y), 200)
    p90 = lgb.train({**p, "objective": "quantile", "alpha": 0.9}, lgb.Dataset(x[train], y), 200)
    return list(zip(mean.predict(x), p90.predict(x)))


def compare(paths: list[str]) -> list[dict]:
    rows = []
    traces = [sorted((json.loads(line) for line in Path(p).read_text().splitlines()),
                     key=lambda r: r["t0"]) for p in paths]
    for kind in ("ttft", "tpot"):
        variants = []
        for fname, fx in FEATURES[kind].items():
            for mode in MODES:
                for rel in (False, True):
                    variants.append((f"RLS {'relative' if rel else 'absolute'}, {mode}", fname,
                                     lambda rs, fx=fx, mo=mode, re=rel:
                                     replay(rs, kind, fx, mo, re)))
            if importlib.util.find_spec("lightgbm") is not None:
                variants.append(("LightGBM (batch fit, first half)", fname,
                                 lambda rs, fx=fx: trees(rs, kind, fx)))
        for model, fname, fit in variants:
            per = [errors(fit(rs), rs, kind) for rs in traces]
            rows.append({"kind": kind, "model": model, "features": fname,
                         "mape": [round(e[0], 3) for e in per],
                         "p90_coverage": [round(e[1], 3) for e in per],
                         "samples": [e[2] for e in per]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args(argv)
    for row in compare(args.traces):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
