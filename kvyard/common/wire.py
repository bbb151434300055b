"""Names on the wire that more than one component must spell the same way.

Sources: ../shared/reference/protocols.md (GAIE ext_proc, vLLM metrics, llm-d
P/D headers).
"""
from __future__ import annotations

# Routing headers (GAIE / llm-d). Clients must never be able to set these.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_METADATA_NAMESPACE = "envoy.lb"
PREFILLER_HEADER = "x-prefiller-host-port"
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
PREFILLER_AUTH_HEADER = "x-kvyard-prefiller-auth"  # the EPP's signature (common/pd_auth.py)
ROUTING_HEADERS = (DESTINATION_HEADER, PREFILLER_HEADER, PREFILLER_AUTH_HEADER)
# SLO routing: the EPP names a request it times in this header; the gateway's observing
# ext_proc filter (gRPC metadata OBSERVE_METADATA) sends that request's headers and
# response to the EPP without waiting for answers (epp/slo/, gateway/config.py).
FLIGHT_HEADER = "x-kvyard-flight"
OBSERVE_METADATA = "x-kvyard-observe"
# Flow control (client-set): llm-d's fairness key, and kvyard's cap on how long the EPP
# may hold this request (milliseconds; it can only shorten the configured TTLs).
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
QUEUE_TTL_HEADER = "x-kvyard-queue-ttl-ms"
# The longest the EPP holds a request: the gateway's ext_proc max_message_timeout, and
# the cap on the EPP's override_message_timeout answers (Envoy ignores larger ones).
MAX_HOLD_S = 900.0

# The gateway's cluster of workers, as the EPP's EDS service names it.
WORKERS_CLUSTER = "kvyard_workers"

# Every worker response names the worker that served it.
ENDPOINT_HEADER = "x-kvyard-endpoint"

# Pod role label (kvyard.io/role: prefill|decode|both).
ROLE_LABEL = "kvyard.io/role"
ROLES = ("prefill", "decode", "both")
# A worker pod's InferencePool when one EPP routes several models (epp/models.py): its base
# model's name.
POOL_LABEL = "kvyard.io/pool"

# Conventional ports (GAIE).
EPP_EXT_PROC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_SCALER_PORT = 9004                  # KEDA's externalscaler.ExternalScaler gRPC

# vLLM metric names that the EPP scrapes and the workers export.
M_WAITING = "vllm:num_requests_waiting"
M_RUNNING = "vllm:num_requests_running"
M_KV_USAGE = "vllm:kv_cache_usage_perc"
M_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
M_CACHE_CONFIG = "vllm:cache_config_info"
M_LORA_INFO = "vllm:lora_requests_info"
M_TTFT = "vllm:time_to_first_token_seconds"
M_TPOT = "vllm:time_per_output_token_seconds"
M_ITL = "vllm:inter_token_latency_seconds"
M_E2E = "vllm:e2e_request_latency_seconds"
M_PROMPT_TOKENS = "vllm:prompt_tokens_total"
M_GENERATION_TOKENS = "vllm:generation_tokens_total"
M_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
M_PREFIX_HITS = "vllm:prefix_cache_hits_total"
M_REQUEST_SUCCESS = "vllm:request_success_total"
# kvyard's own: prompt tokens admitted but not computed yet (queued, parked or mid-prefill),
# the prefill backlog the EPP's KEDA scaler divides by the measured prefill rate.
M_PROMPT_TOKENS_PENDING = "kvyard:prompt_tokens_pending"

# P/D (llm-d / vLLM): the request field both legs carry, and the decode worker's metrics.
KV_TRANSFER_PARAMS = "kv_transfer_params"
M_WORKER_INFO = "kvyard:worker_info"
M_PD_HANDOFFS = "kvyard:pd_handoffs_total"
M_PD_FALLBACKS = "kvyard:pd_fallbacks_total"
M_PD_HANDOFF_SECONDS = "kvyard:pd_handoff_seconds"
M_PD_HANDOFF_BYTES = "kvyard:pd_handoff_bytes_total"
M_PD_REJECTED = "kvyard:pd_rejected_prefill_targets_total"
M_PD_TRANSFERS = "kvyard:pd_transfers_total"              # {transport="shm|tcp"}
M_PD_PHASE_SECONDS = "kvyard:pd_handoff_phase_seconds"    # {phase}
M_PD_STREAMED_BLOCKS = "kvyard:pd_streamed_blocks_total"   # {when="during_prefill|after_prefill"}
M_KV_EVENT_BATCHES = "kvyard:kv_event_batches_total"      # --kv-events-config publishing
M_KV_EVENTS_DROPPED = "kvyard:kv_events_dropped_total"
M_PD_HELD_BLOCKS = "kvyard:pd_held_blocks"                # prefill side
M_PD_HOLDS = "kvyard:pd_holds_total"                      # {outcome}, prefill side

# Sleep mode (vLLM's --enable-sleep-mode): 1 while a worker sleeps; the EPP sends it nothing.
M_SLEEPING = "kvyard:sleeping"

# Kubernetes: the CRD, the labels and ports the operator (operator/) and the Helm
# chart (charts/kvyard) both write. Fixed contracts; operator/README.md lists them.
K8S_GROUP = "kvyard.io"
CRD_VERSION = "v1alpha1"
CRD_KIND = "InferenceService"
CRD_PLURAL = "inferenceservices"
CRD_SINGULAR = "inferenceservice"
CRD_SHORT_NAME = "kis"
CRD_NAME = f"{CRD_PLURAL}.{K8S_GROUP}"
FIELD_MANAGER = "kvyard-operator"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "kvyard-operator"
SERVICE_LABEL = "kvyard.io/service"      # the InferenceService a child belongs to
COMPONENT_LABEL = "kvyard.io/component"  # worker | epp | gateway
COMPONENTS = ("worker", "epp", "gateway")
WORKER_HTTP_PORT = 8000
WORKER_KV_PEER_PORT = 8001               # P/D: the prefill side's KV transfer endpoint
# A worker pod's KV-event publisher (vLLM's usual PUB and replay ports) and the pod
# annotations the EPP's Kubernetes discovery reads them from (the operator writes them).
WORKER_KV_EVENTS_PORT = 5557
WORKER_KV_REPLAY_PORT = 5558
KV_EVENTS_PORT_ANNOTATION = "kvyard.io/kv-events-port"
KV_REPLAY_PORT_ANNOTATION = "kvyard.io/kv-events-replay-port"
GATEWAY_HTTP_PORT = 8080
GATEWAY_ADMIN_PORT = 9901                # bound to 127.0.0.1 inside the pod
IMAGE_REPOSITORY = "ghcr.io/kvyard/kvyard"  # tag: the kvyard version
RUN_AS_USER = 65532                      # every container: non-root, read-only root fs
PD_KEY_ENV = "KVYARD_PD_KEY_FILE"
REDIS_PASSWORD_ENV = "KVYARD_REDIS_PASSWORD"
INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_VERSION = "v1"
