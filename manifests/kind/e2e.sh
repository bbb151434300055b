#!/usr/bin/env bash
# kvyard on kind, end to end, the path a user runs first:
#   1. create a kind cluster (manifests/kind/kind-config.yaml)
#   2. build the CPU image (Dockerfile) and load it into the nodes
#   3. install KEDA, then the chart with charts/kvyard/values-cpu.yaml (CRD, operator, Redis,
#      and the `demo` InferenceService: two CPU workers on SmolLM2-135M, an EPP, a gateway)
#   4. wait until the InferenceService is Ready and its Deployments have rolled out
#   5. send chat requests through the gateway and check the answers and the routing, the EPP's
#      view, the Redis tier, what the gateway does not expose, and one NetworkPolicy
#   6. helm upgrade with a changed value: the CRD hook runs, the EPP rolls, chat still works
#   7. a service that scales to zero: KEDA takes it to 0 when idle, a request wakes it
#   8. a P/D service (prefill + decode pools): a long prompt is prefilled on the prefill pool
#   9. helm uninstall, and check nothing of any InferenceService is left (the CRD stays: Helm
#      never deletes crds/, and deleting it would delete every InferenceService in the cluster)
#  10. delete the cluster (KEEP=1 keeps it for a look around)
#
# Needs: docker, kind >= 0.24 (NetworkPolicies enforced by kindnetd), kubectl, helm >= 3.14,
# python3, and network access for the KEDA chart and the Redis image.
# Knobs (environment): CLUSTER, NAMESPACE, IMAGE, KEDA_VERSION, LOCAL_PORT, KEEP=1, SKIP_BUILD=1.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="${CLUSTER:-kvyard-e2e}"
NAMESPACE="${NAMESPACE:-kvyard}"
SERVICE=demo                                   # inferenceService.name in values-cpu.yaml
CHART_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/charts/kvyard/Chart.yaml")"
IMAGE="${IMAGE:-ghcr.io/kvyard/kvyard:${CHART_VERSION}}"  # the operator's default worker image
KEDA_VERSION="${KEDA_VERSION:-}"              # empty: the kedacore chart's latest
LOCAL_PORT="${LOCAL_PORT:-18080}"
KEEP="${KEEP:-0}"
PF_PID=""
CREATED=0                                      # only a cluster this run created is deleted

log() { printf '\n=== %s\n' "$*"; }
die() { printf 'e2e: FAILED: %s\n' "$*" >&2; exit 1; }

stop_forward() {
  if [ -n "$PF_PID" ]; then
    kill "$PF_PID" 2>/dev/null || true
    wait "$PF_PID" 2>/dev/null || true
    PF_PID=""
  fi
}

# forward SERVICE: its gateway on 127.0.0.1:$LOCAL_PORT, once the gateway's /health answers
forward() {
  stop_forward
  kubectl -n "$NAMESPACE" port-forward "svc/$1-gateway" "$LOCAL_PORT:8080" >/dev/null 2>&1 &
  PF_PID=$!
  for _ in $(seq 1 60); do
    if python3 -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
        "http://127.0.0.1:$LOCAL_PORT/health" 2>/dev/null; then
      return 0
    fi
    sleep 1
  done
  die "the gateway of $1 never answered /health through the port-forward"
}

# chat TIMEOUT_S PROMPT: one chat request through the forwarded gateway must be a 200;
# prints the serving endpoint
chat() {
  python3 - "$LOCAL_PORT" "$1" "$2" <<'PY'
import json, sys, urllib.error, urllib.request
port, timeout, prompt = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
base = f"http://127.0.0.1:{port}"
model = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=timeout))["data"][0]["id"]
body = {"model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": prompt}]}
req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"content-type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
        answer = json.load(r)
        print(r.headers.get("x-kvyard-endpoint", "?"), repr(answer["choices"][0]["message"]["content"]))
except urllib.error.HTTPError as e:
    sys.exit(f"e2e: chat through the gateway: HTTP {e.code}: {e.read()[:300]!r}")
PY
}

# ready SERVICE DEPLOYMENT...: the operator's Deployments exist, rolled out, and Ready
ready() {
  local svc="$1"; shift
  local names=()
  for d in "$@"; do names+=("$svc-$d"); done
  for _ in $(seq 1 60); do
    kubectl -n "$NAMESPACE" get deployment "${names[@]}" >/dev/null 2>&1 && break
    sleep 5
  done
  for d in "${names[@]}"; do
    kubectl -n "$NAMESPACE" rollout status deployment "$d" --timeout 10m
  done
  kubectl -n "$NAMESPACE" wait --for=condition=Ready "inferenceservice/$svc" --timeout 5m
}

for tool in docker kind kubectl helm python3; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed"
done

dump() {  # what a failed run leaves to read
  kubectl -n "$NAMESPACE" get inferenceservices,deployments,pods,services,networkpolicies -o wide || true
  kubectl -n "$NAMESPACE" describe inferenceservice "$SERVICE" || true
  for d in $(kubectl -n "$NAMESPACE" get deployments -o name 2>/dev/null); do
    echo "--- logs $d"; kubectl -n "$NAMESPACE" logs "$d" --all-containers --tail=40 || true
  done
}

cleanup() {
  local rc=$?
  stop_forward
  if [ "$CREATED" = 1 ]; then
    if [ "$rc" -ne 0 ]; then dump; fi
    if [ "$KEEP" = 1 ]; then
      echo "e2e: cluster $CLUSTER kept (kind delete cluster --name $CLUSTER)"
    else
      kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT

log "kind cluster $CLUSTER"
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  die "a cluster named $CLUSTER exists already; delete it or set CLUSTER"
fi
CREATED=1
kind create cluster --name "$CLUSTER" --config "$ROOT/manifests/kind/kind-config.yaml" --wait 180s
kubectl config use-context "kind-$CLUSTER" >/dev/null

log "image $IMAGE"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  docker build -t "$IMAGE" "$ROOT"
fi
kind load docker-image "$IMAGE" --name "$CLUSTER"

log "KEDA ${KEDA_VERSION:-(latest)}"
helm repo add kedacore https://kedacore.github.io/charts --force-update >/dev/null
helm upgrade --install keda kedacore/keda --namespace keda --create-namespace \
  ${KEDA_VERSION:+--version "$KEDA_VERSION"} --wait --timeout 5m

log "kvyard chart (values-cpu.yaml) into namespace $NAMESPACE"
# --wait: the chart's own Deployments (operator, Redis) are ready; the InferenceService's
# children come from the operator afterwards.
helm upgrade --install kvyard "$ROOT/charts/kvyard" --namespace "$NAMESPACE" --create-namespace \
  -f "$ROOT/charts/kvyard/values-cpu.yaml" --wait --timeout 5m
kubectl -n "$NAMESPACE" get inferenceservice "$SERVICE" >/dev/null

log "waiting for InferenceService $SERVICE to be Ready"
# The operator creates <svc>-both, <svc>-epp and <svc>-gateway; workers load the model and
# compile their CPU kernels on first start (a minute or two on a laptop).
ready "$SERVICE" both epp gateway
kubectl -n "$NAMESPACE" get inferenceservice "$SERVICE"
WORKER_IPS="$(kubectl -n "$NAMESPACE" get pods \
  -l "kvyard.io/service=$SERVICE,kvyard.io/component=worker" \
  --field-selector=status.phase=Running -o jsonpath='{.items[*].status.podIP}')"
echo "workers: $WORKER_IPS"
[ "$(wc -w <<<"$WORKER_IPS")" -eq 2 ] || die "expected 2 running workers, got: $WORKER_IPS"

log "gateway: kubectl port-forward svc/$SERVICE-gateway $LOCAL_PORT:8080"
forward "$SERVICE"

log "chat requests through the gateway"
WORKER_IPS="$WORKER_IPS" python3 - "$LOCAL_PORT" <<'PY'
"""Through the gateway: every answer a 200 in OpenAI's shape, served by one of the two
workers (x-kvyard-endpoint), the same prompt always by the same worker (the EPP's prefix
affinity: each prompt's blocks are its own from the first token, so only the worker that
served it holds them), and bad input answered with a 400 in OpenAI's shape."""
import json
import os
import sys
import time
import urllib.error
import urllib.request

port = int(sys.argv[1])
base = f"http://127.0.0.1:{port}"
workers = set(os.environ["WORKER_IPS"].split())


def post(body: dict, timeout: float = 120.0):
    """(status, headers (case-insensitive), JSON body)."""
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read() or b"{}")


deadline = time.monotonic() + 120
while True:  # the port-forward and the gateway's first EDS assignment
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
            models = json.load(r)
        break
    except Exception as e:  # noqa: BLE001
        if time.monotonic() > deadline:
            sys.exit(f"e2e: the gateway never answered /v1/models: {e}")
        time.sleep(1)
model = models["data"][0]["id"]
print(f"model: {model}")

filler = ("You are a terse assistant for kvyard's end-to-end test. " * 24).strip()
served = {}
for i, question in enumerate(["What is 2+2?", "Name a colour.", "Say hello.", "Count to 3."]):
    system = f"Conversation {i}. {filler}"  # ~300 tokens (~19 blocks) no other prompt shares
    body = {"model": model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}]}
    for attempt in range(3):  # the same prompt three times
        status, headers, answer = post(body)
        if status != 200:
            sys.exit(f"e2e: {question!r}: HTTP {status}: {answer}")
        text = answer["choices"][0]["message"]["content"]
        endpoint = headers.get("x-kvyard-endpoint", "")
        host = endpoint.rsplit(":", 1)[0]
        if host not in workers:
            sys.exit(f"e2e: served by {endpoint!r}, not one of the workers {sorted(workers)}")
        served.setdefault(question, set()).add(endpoint)
        print(f"{question!r} #{attempt}: {endpoint}: {text!r}")
        if not text:
            sys.exit("e2e: empty answer")
for question, hosts in served.items():
    if len(hosts) != 1:
        sys.exit(f"e2e: the same prompt went to several workers {hosts}: no prefix affinity")
print(f"routing: each prompt stayed on one worker; used: {sorted(set().union(*served.values()))}")

# OpenAI-shaped errors through the gateway, never a 5xx
status, _, answer = post({"model": model, "messages": [{"role": "wizard", "content": "x"}]})
if status != 400 or "error" not in answer:
    sys.exit(f"e2e: a bad role got HTTP {status}: {answer}")
print("bad input: 400 in OpenAI's shape")

# the API only: a worker's internals are a 404 at the gateway, its health is the gateway's own
for path in ("/metrics", "/version", "/is_sleeping"):
    try:
        urllib.request.urlopen(f"{base}{path}", timeout=10)
        sys.exit(f"e2e: the gateway answered {path}")
    except urllib.error.HTTPError as e:
        err = json.loads(e.read())["error"]
        if e.code != 404 or err["code"] != "not_found":
            sys.exit(f"e2e: {path}: HTTP {e.code} {err}")
with urllib.request.urlopen(f"{base}/health", timeout=10) as r:
    if r.status != 200 or b"kv" in r.read():
        sys.exit("e2e: the gateway's /health is not its own minimal answer")
print("gateway: /metrics, /version, /is_sleeping are 404; /health is the gateway's own")
PY

log "EPP view and the workers' KV tiers"
EPP_POD="$(kubectl -n "$NAMESPACE" get pods -l "kvyard.io/service=$SERVICE,kvyard.io/component=epp" \
  -o jsonpath='{.items[0].metadata.name}')"
kubectl -n "$NAMESPACE" exec "$EPP_POD" -- python3 -c "
import json, urllib.request
eps = json.load(urllib.request.urlopen('http://127.0.0.1:9090/debug/endpoints', timeout=5))['endpoints']
for e in eps:
    print(e['address'], e['role'], 'picks', e['picks'], 'prefix hits', e['prefix_hits'], 'fresh', e['fresh'])
hosts = sorted(e['address'].rsplit(':', 1)[0] for e in eps if e['fresh'] and not e['down'])
assert hosts == sorted('$WORKER_IPS'.split()), f'the EPP sees {hosts}, not the workers'
assert sum(e['picks'] for e in eps) >= 12, 'the EPP did not route the 12 chat requests'
"
WORKER_POD="$(kubectl -n "$NAMESPACE" get pods -l "kvyard.io/service=$SERVICE,kvyard.io/component=worker" \
  -o jsonpath='{.items[0].metadata.name}')"
kubectl -n "$NAMESPACE" exec "$WORKER_POD" -- python3 -c "
import urllib.request
text = urllib.request.urlopen('http://127.0.0.1:8000/metrics', timeout=5).read().decode()
up = [l for l in text.splitlines() if l.startswith('kvyard:kvstore_tier_up')]
print('\n'.join(up))
assert any('tier=\"redis\"' in l and l.endswith(' 1.0') for l in up), 'the Redis tier is not up'
"

log "NetworkPolicy: a pod outside the service cannot reach a worker; a worker can"
WORKER_IP="${WORKER_IPS%% *}"
PROBE="
import socket, sys
try:
    socket.create_connection(('$WORKER_IP', 8000), timeout=5).close(); print('OPEN')
except OSError as e:
    print('BLOCKED', e)
"
verdict="$(kubectl -n "$NAMESPACE" run np-probe --rm -i --restart=Never --quiet --image="$IMAGE" \
  --image-pull-policy=IfNotPresent --command -- python3 -c "$PROBE" 2>&1 || true)"
echo "stranger -> $WORKER_IP:8000: $verdict"
case "$verdict" in
  *BLOCKED*) ;;
  *OPEN*) die "a pod outside the service reached worker $WORKER_IP:8000" ;;
  *) die "the probe pod did not run: $verdict" ;;
esac
OTHER_WORKER="$(kubectl -n "$NAMESPACE" get pods -l "kvyard.io/service=$SERVICE,kvyard.io/component=worker" \
  -o jsonpath="{.items[?(@.status.podIP!='$WORKER_IP')].metadata.name}")"
verdict="$(kubectl -n "$NAMESPACE" exec "$OTHER_WORKER" -- python3 -c "$PROBE" 2>&1 || true)"
echo "worker -> $WORKER_IP:8000: $verdict"
case "$verdict" in *OPEN*) ;; *) die "a worker of the service could not reach $WORKER_IP:8000" ;; esac

log "helm upgrade with a changed value: the CRD is replaced, the EPP rolls, chat still works"
stop_forward
EPP_HASH="$(kubectl -n "$NAMESPACE" get deployment "$SERVICE-epp" \
  -o jsonpath='{.spec.template.metadata.annotations.kvyard\.io/config-hash}')"
helm upgrade kvyard "$ROOT/charts/kvyard" --namespace "$NAMESPACE" \
  -f "$ROOT/charts/kvyard/values-cpu.yaml" \
  --set inferenceService.spec.routing.scorers.queue=3 --wait --timeout 5m
[ "$(kubectl -n "$NAMESPACE" get inferenceservice "$SERVICE" \
  -o jsonpath='{.spec.routing.scorers.queue}')" = 3 ] || die "the upgrade did not reach the spec"
kubectl get crd inferenceservices.kvyard.io >/dev/null || die "the CRD is gone after the upgrade"
for _ in $(seq 1 60); do
  new_hash="$(kubectl -n "$NAMESPACE" get deployment "$SERVICE-epp" \
    -o jsonpath='{.spec.template.metadata.annotations.kvyard\.io/config-hash}')"
  [ "$new_hash" != "$EPP_HASH" ] && break
  sleep 2
done
[ "$new_hash" != "$EPP_HASH" ] || die "the EPP's scheduler config did not change with the value"
ready "$SERVICE" both epp gateway
forward "$SERVICE"
chat 120 "after the upgrade"

log "scale to zero and wake: InferenceService nap"
stop_forward
kubectl -n "$NAMESPACE" apply -f - <<'YAML'
apiVersion: kvyard.io/v1alpha1
kind: InferenceService
metadata:
  name: nap
spec:
  model: {source: demo}
  engine:
    maxModelLen: 1024
    kvCacheMemory: 128Mi
    resources: {requests: {cpu: 250m, memory: 1Gi}, limits: {memory: 2Gi}}
  pools:
    both: {minReplicas: 0, maxReplicas: 1}
  scaleToZero: {enabled: true, idleSeconds: 30, coldStartSeconds: 600}
YAML
kubectl -n "$NAMESPACE" wait --for=condition=Ready inferenceservice/nap --timeout 10m || true
kubectl -n "$NAMESPACE" rollout status deployment nap-epp --timeout 5m
kubectl -n "$NAMESPACE" rollout status deployment nap-gateway --timeout 5m
zero=0
for _ in $(seq 1 90); do   # KEDA's step to zero: idleSeconds without demand, plus its cooldown
  if [ "$(kubectl -n "$NAMESPACE" get deployment nap-both -o jsonpath='{.spec.replicas}')" = 0 ]; then
    zero=1; break
  fi
  sleep 5
done
[ "$zero" = 1 ] || die "nap-both never scaled to zero"
echo "nap-both: 0 replicas"
forward nap
chat 600 "wake up"          # held by the EPP's waiting room while KEDA and the pod start
[ "$(kubectl -n "$NAMESPACE" get deployment nap-both -o jsonpath='{.spec.replicas}')" -ge 1 ] \
  || die "nap-both answered without a replica"
stop_forward
kubectl -n "$NAMESPACE" delete inferenceservice nap --wait --timeout 5m

log "P/D: InferenceService pd (a prefill pool and a decode pool)"
kubectl -n "$NAMESPACE" apply -f - <<'YAML'
apiVersion: kvyard.io/v1alpha1
kind: InferenceService
metadata:
  name: pd
spec:
  model: {source: demo}
  engine:
    maxModelLen: 2048
    kvCacheMemory: 128Mi
    resources: {requests: {cpu: 250m, memory: 1Gi}, limits: {memory: 2Gi}}
  pools:
    prefill: {replicas: 1}
    decode: {replicas: 1}
  routing:
    pd: {nonCachedTokens: 64}
YAML
ready pd prefill decode epp gateway
forward pd
chat 300 "$(printf 'A long prompt for the prefill pool, sentence %s. ' $(seq 1 40))"
stop_forward
PD_EPP="$(kubectl -n "$NAMESPACE" get pods -l "kvyard.io/service=pd,kvyard.io/component=epp" \
  -o jsonpath='{.items[0].metadata.name}')"
kubectl -n "$NAMESPACE" exec "$PD_EPP" -- python3 -c "
import json, urllib.request
eps = json.load(urllib.request.urlopen('http://127.0.0.1:9090/debug/endpoints', timeout=5))['endpoints']
for e in eps:
    print(e['address'], e['role'], 'picks', e['picks'])
roles = {e['role']: e['picks'] for e in eps}
assert roles.get('prefill', 0) >= 1, f'the prefill pool was never picked: {roles}'
assert roles.get('decode', 0) >= 1, f'the decode pool was never picked: {roles}'
"

log "helm uninstall: nothing of any InferenceService is left"
# The chart's pre-delete Job deletes every InferenceService the operator watches (demo and pd
# here) while the operator still runs; the operator releases them and the garbage collector
# removes their children (owner references).
helm uninstall kvyard --namespace "$NAMESPACE" --wait --timeout 5m
left="?"
for _ in $(seq 1 60); do
  left="$(kubectl -n "$NAMESPACE" get inferenceservices -o name 2>/dev/null || true)"
  left+="$(kubectl -n "$NAMESPACE" get deployments,services,configmaps,secrets,serviceaccounts,roles,rolebindings,scaledobjects,networkpolicies,poddisruptionbudgets,jobs \
    -l "app.kubernetes.io/managed-by in (kvyard-operator,Helm)" -o name 2>/dev/null || true)"
  [ -z "$left" ] && break
  sleep 2
done
[ -z "$left" ] || die "left behind after helm uninstall: $left"
hooks="$(kubectl get clusterroles,clusterrolebindings -o name | grep -E "kvyard-(cleanup|crd)" || true)"
[ -z "$hooks" ] || die "hook RBAC left behind: $hooks"
kubectl get crd inferenceservices.kvyard.io >/dev/null \
  || die "the CRD was deleted (Helm keeps crds/: deleting it is the user's choice)"
echo "nothing left (the CRD stays: kubectl delete crd inferenceservices.kvyard.io)"

log "e2e passed"
