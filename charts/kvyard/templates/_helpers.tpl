{{/* Names, labels and the few computed values the templates share. */}}

{{- define "kvyard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvyard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvyard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvyard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvyard
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one of the chart's own components: (dict "ctx" $ "component" "operator") */}}
{{- define "kvyard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvyard.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* repository:tag, or repository:tag@digest when a digest pins it: (dict "repo" R "tag" T "digest" D) */}}
{{- define "kvyard.imageRef" -}}
{{- $ref := printf "%s:%s" .repo (toString .tag) -}}
{{- if .digest -}}{{- $ref = printf "%s@%s" $ref .digest -}}{{- end -}}
{{- $ref -}}
{{- end -}}

{{/* image.tag, else the chart's appVersion: every kvyard tag derives from it. */}}
{{- define "kvyard.tag" -}}
{{- toString (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The image the operator runs, and the default image of every InferenceService's pods. */}}
{{- define "kvyard.operatorImage" -}}
{{- $o := .Values.operator.image | default dict -}}
{{- if or $o.repository $o.tag $o.digest -}}
{{- include "kvyard.imageRef" (dict "repo" ($o.repository | default .Values.image.repository) "tag" ($o.tag | default (include "kvyard.tag" .)) "digest" $o.digest) -}}
{{- else -}}
{{- include "kvyard.defaultImage" . -}}
{{- end -}}
{{- end -}}

{{- define "kvyard.operatorPullPolicy" -}}
{{- $o := .Values.operator.image | default dict -}}
{{- $o.pullPolicy | default .Values.image.pullPolicy -}}
{{- end -}}

{{- define "kvyard.defaultImage" -}}
{{- include "kvyard.imageRef" (dict "repo" .Values.image.repository "tag" (include "kvyard.tag" .) "digest" .Values.image.digest) -}}
{{- end -}}

{{/* The CUDA variant (workers on device cuda): the same tag with -cuda, or its own digest. */}}
{{- define "kvyard.cudaImage" -}}
{{- include "kvyard.imageRef" (dict "repo" .Values.image.repository "tag" (printf "%s-cuda" (include "kvyard.tag" .)) "digest" .Values.image.cudaDigest) -}}
{{- end -}}

{{- define "kvyard.operatorName" -}}
{{- printf "%s-operator" (include "kvyard.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvyard.redisName" -}}
{{- printf "%s-redis" (include "kvyard.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Secret and key that hold the Redis password, for the chart's Redis or an external one. */}}
{{- define "kvyard.redisSecretName" -}}
{{- if .Values.redis.enabled -}}
{{- default (include "kvyard.redisName" .) .Values.redis.auth.existingSecret -}}
{{- else -}}
{{- .Values.redis.external.secretName -}}
{{- end -}}
{{- end -}}

{{- define "kvyard.redisSecretKey" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.auth.existingSecret -}}{{ .Values.redis.auth.existingSecretKey }}{{- else -}}password{{- end -}}
{{- else -}}
{{- .Values.redis.external.secretKey -}}
{{- end -}}
{{- end -}}

{{- define "kvyard.redisURL" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s.%s.svc:6379" (include "kvyard.redisName" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* Names of the InferenceServices whose pods get per-service NetworkPolicies and PDBs. */}}
{{- define "kvyard.services" -}}
{{- $names := list -}}
{{- if .Values.inferenceService.enabled -}}{{- $names = append $names .Values.inferenceService.name -}}{{- end -}}
{{- range .Values.networkPolicy.services -}}{{- $names = append $names . -}}{{- end -}}
{{- $names | uniq | toJson -}}
{{- end -}}

{{/* Labels the operator puts on every pod of an InferenceService: (dict "service" NAME "component" C) */}}
{{- define "kvyard.podSelector" -}}
app.kubernetes.io/managed-by: kvyard-operator
kvyard.io/service: {{ .service | quote }}
kvyard.io/component: {{ .component }}
{{- end -}}

{{/* Security contexts: non-root, read-only root filesystem, no capabilities. */}}
{{- define "kvyard.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .uid }}
runAsGroup: {{ .uid }}
fsGroup: {{ .uid }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvyard.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: [ALL]
{{- end -}}

{{/* imagePullSecrets as names, comma-separated (entries may be {name: x} or plain strings). */}}
{{- define "kvyard.pullSecretNames" -}}
{{- $names := list -}}
{{- range .Values.imagePullSecrets -}}
{{- if kindIs "string" . -}}{{- $names = append $names . -}}{{- else -}}{{- $names = append $names .name -}}{{- end -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{- /*
EPP replicas of one listed service: spec.epp.replicas of the chart's own InferenceService
(inferenceService.enabled and the name matches), else 1 (a service made elsewhere: unknown).
*/ -}}
{{- define "kvyard.eppReplicas" -}}
{{- $is := .root.Values.inferenceService -}}
{{- if and $is.enabled (eq .service $is.name) -}}
{{- (($is.spec | default dict).epp | default dict).replicas | default 1 -}}
{{- else -}}
1
{{- end -}}
{{- end }}
