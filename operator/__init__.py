"""kvyard's Kubernetes operator (`kvyard operator`, kopf): InferenceService -> children.

Layout: `schema.py` (the CRD's OpenAPI schema, the one source of truth) and
`crd.py` (the CRD manifest, defaults); `spec.py` (the spec as typed values);
`render*.py` (pure: spec -> manifests); `status.py` (pure: children -> status);
`client.py` (the few API calls, server-side apply); `handover.py` (hands
`spec.replicas` to KEDA's HPA without a gap); `watch.py` (owned Deployments and pods,
seen through watches, for status); `reconcile.py` (one pass);
`handlers.py` (kopf wiring); `rbac.py` (the permissions those calls need);
`cli.py` (`kvyard operator`). For tests: `schema_check.py` (an object against the
schema and its CEL rules), `testing.py` (an emulated API on kmock, with `testing_schema.py`'s pruning and
defaults and `testing_ssa.py`'s server-side apply field ownership), `localrun.py`
(rendered pods run as local processes). README.md has the contracts and decisions.
It never imports the EPP or the workers: what they must agree on is in
`kvyard.common.wire`, and their flags are checked by tests.
"""
if __name__ == "operator":
    # This folder is `kvyard.operator` (setup.py's package-dir), never the top-level
    # `operator`; but `python -m ...` run from a checkout puts the checkout first on
    # sys.path, and then the standard library's `collections` would import this file as
    # `operator`. Become the standard library's module instead (its source, run here).
    import os as _os  # neither os nor importlib.machinery imports operator
    import sys as _sys
    from importlib.machinery import PathFinder as _PathFinder

    _stdlib = _os.path.dirname(_os.__file__)
    _spec = _PathFinder.find_spec("operator", [_stdlib])
    if _spec is None or _spec.loader is None:
        raise ImportError("the standard library's operator module was not found")
    _spec.loader.exec_module(_sys.modules[__name__])
