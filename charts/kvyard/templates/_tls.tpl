{{- /* TLS on the EPPs' ext_proc and scaler ports (values `tls`; operator/render_tls.py). */ -}}

{{- define "kvyard.tlsIssuerName" -}}
{{- ((.Values.tls.certManager | default dict).issuerRef | default dict).name | default "" -}}
{{- end -}}

{{/* cert-manager issuerRef as the operator's --epp-tls-issuer: GROUP/KIND/NAME. */}}
{{- define "kvyard.tlsIssuer" -}}
{{- $ref := (.Values.tls.certManager | default dict).issuerRef | default dict -}}
{{- printf "%s/%s/%s" ($ref.group | default "cert-manager.io") ($ref.kind | default "ClusterIssuer") $ref.name -}}
{{- end -}}

{{- define "kvyard.tlsTriggerAuthName" -}}
{{- printf "%s-epp-tls" (include "kvyard.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Secret in KEDA's namespace that the ClusterTriggerAuthentication reads. */}}
{{- define "kvyard.tlsKedaSecret" -}}
{{- if .Values.tls.keda.secretName -}}
{{- .Values.tls.keda.secretName -}}
{{- else if include "kvyard.tlsIssuerName" . -}}
{{- printf "%s-keda-client" (include "kvyard.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- .Values.tls.secretName -}}
{{- end -}}
{{- end -}}

{{/* The operator's environment for TLS (its flags' defaults, operator/cli.py). */}}
{{- define "kvyard.tlsEnv" -}}
{{- $issuer := include "kvyard.tlsIssuerName" . -}}
{{- if and $issuer .Values.tls.secretName -}}
{{- fail "tls: secretName or certManager.issuerRef, not both" -}}
{{- end -}}
{{- if not (or $issuer .Values.tls.secretName) -}}
{{- fail "tls.enabled needs tls.secretName or tls.certManager.issuerRef.name" -}}
{{- end -}}
{{- if $issuer }}
- name: KVYARD_EPP_TLS_ISSUER
  value: {{ include "kvyard.tlsIssuer" . | quote }}
{{- else }}
- name: KVYARD_EPP_TLS_SECRET
  value: {{ .Values.tls.secretName | quote }}
{{- end }}
- name: KVYARD_EPP_TLS_MUTUAL
  value: {{ .Values.tls.mutual | quote }}
{{- if .Values.tls.keda.triggerAuthentication }}
- name: KVYARD_EPP_TLS_TRIGGER_AUTH
  value: {{ printf "ClusterTriggerAuthentication/%s" (include "kvyard.tlsTriggerAuthName" .) | quote }}
{{- end }}
{{- end -}}
