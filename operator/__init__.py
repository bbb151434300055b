"""kvyard's Kubernetes operator (`kvyard operator`, kopf): InferenceService -> children.

Layout: `schema.py` (the CRD's OpenAPI schema, the one source of truth) and
`crd.py` (the CRD manifest, defaults); `spec.py` (the spec as typed values);
`render*.py` (pure: spec -> manifests); `status.py` (pure: children -> status);
`client.py` (the few API calls, server-side apply); `reconcile.py` (one pass);
`handlers.py` (kopf wiring); `rbac.py` (the permissions those calls need).
It never imports the EPP or the workers: what they must agree on is in
`kvyard.common.wire`, and their flags are checked by tests.
"""
