{{/* Names ------------------------------------------------------------------------------ */}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object's name: the release name, plus the chart name unless the
release name already contains it. Component suffixes are at most 9 characters. */}}
{{- define "baton.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels: call with (dict "root" $ "component" "router"). */}}
{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "baton.labels" -}}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/part-of: baton
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end }}

{{/* Peers of this release that may call workers and Redis: the router and the workers
(the planner only reads the routers' metrics and the Kubernetes API). */}}
{{- define "baton.releasePeers" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "baton.name" . }}
      app.kubernetes.io/instance: {{ .Release.Name }}
    matchExpressions:
      - {key: app.kubernetes.io/component, operator: In, values: [router, prefill, decode]}
{{- end }}

{{/* Values derived from several places ------------------------------------------------- */}}
{{/* A block's image: call with (dict "root" $ "block" BLOCK); empty fields fall back to
the top-level image, an empty tag to the chart's appVersion. */}}
{{- define "baton.image" -}}
{{- $img := .root.Values.image }}
{{- $own := .block.image | default dict }}
{{- printf "%s:%s" ($own.repository | default $img.repository) ($own.tag | default ($img.tag | default .root.Chart.AppVersion)) }}
{{- end }}

{{- define "baton.pullPolicy" -}}
{{- $own := .block.image | default dict }}
{{- $own.pullPolicy | default .root.Values.image.pullPolicy }}
{{- end }}

{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "baton.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The registry's key prefix: one per release, so releases sharing a Redis never see
each other's workers. */}}
{{- define "baton.registryPrefix" -}}
{{- .Values.redis.prefix | default (printf "%s/%s" .Release.Namespace .Release.Name) }}
{{- end }}

{{- define "baton.apiKeySecret" -}}
{{- .Values.router.apiKey.existingSecret | default (printf "%s-api-key" (include "baton.fullname" .)) }}
{{- end }}

{{- define "baton.apiKeyEnabled" -}}
{{- if or .Values.router.apiKey.existingSecret .Values.router.apiKey.value }}true{{ end }}
{{- end }}

{{/* Whether the planner or an autoscaler owns a pool's replicas: call with (dict "root" $
"role" ROLE); "true" or "". */}}
{{- define "baton.replicasOwnedElsewhere" -}}
{{- if or .root.Values.planner.enabled (index .root.Values .role).autoscaling.kind }}true{{ end }}
{{- end }}

{{/* A PodDisruptionBudget's budget: call with a block's pdb values; minAvailable wins. */}}
{{- define "baton.pdbBudget" -}}
{{- if not (kindIs "invalid" .minAvailable) }}
minAvailable: {{ .minAvailable }}
{{- else if not (kindIs "invalid" .maxUnavailable) }}
maxUnavailable: {{ .maxUnavailable }}
{{- else }}
{{- fail "pdb: set minAvailable or maxUnavailable" }}
{{- end }}
{{- end }}

{{/* terminationGracePeriodSeconds: the preStop sleep, the drain, and 10 s to exit. */}}
{{- define "baton.gracePeriod" -}}
{{- add .Values.drain.preStopSleepSeconds .Values.drain.timeoutSeconds 10 }}
{{- end }}

{{/* HTTP probes of the router and the workers: liveness on /health (the process answers),
readiness on /ready (it can take requests; 503 while loading and once draining). */}}
{{- define "baton.httpProbes" -}}
livenessProbe:
  httpGet: {path: /health, port: http}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
readinessProbe:
  httpGet: {path: /ready, port: http}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
{{- end }}

{{/* The tuning ConfigMap, mounted as a directory (never subPath: kubelet's updates must
reach the running services). */}}
{{- define "baton.tuningMount" -}}
- {name: tuning, mountPath: /etc/baton, readOnly: true}
{{- end }}

{{- define "baton.tuningVolume" -}}
- name: tuning
  configMap: {name: {{ include "baton.fullname" . }}-tuning}
{{- end }}

{{/* Tracing: `--otlp-endpoint` (OTLP/HTTP) for the router and the workers, and the standard
OTEL_* variables the OpenTelemetry SDK reads (sampler, resource attributes). */}}
{{- define "baton.tracingArgs" -}}
{{- with .Values.tracing.otlpEndpoint }}
- --otlp-endpoint
- {{ . }}
{{- else }}
[]
{{- end }}
{{- end }}

{{- define "baton.tracingEnv" -}}
{{- $t := .root.Values.tracing }}
{{- if $t.otlpEndpoint }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: k8s.namespace.name={{ .root.Release.Namespace }},service.namespace={{ .root.Release.Name }}
{{- if not (kindIs "invalid" $t.samplerRatio) }}
- {name: OTEL_TRACES_SAMPLER, value: parentbased_traceidratio}
- {name: OTEL_TRACES_SAMPLER_ARG, value: {{ $t.samplerRatio | toString | quote }}}
{{- end }}
{{- else }}
[]
{{- end }}
{{- end }}

{{/* The pods' own IP (advertised to the registry) and namespace. */}}
{{- define "baton.podIPEnv" -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- end }}

{{/* Who may scrape the workers' HTTP port: networkPolicy.metricsFrom, else (ServiceMonitor
on) Prometheus Operator's Prometheus pods in any namespace, else nobody outside the release. */}}
{{- define "baton.metricsFrom" -}}
{{- if .Values.networkPolicy.metricsFrom }}
{{- toYaml .Values.networkPolicy.metricsFrom }}
{{- else if .Values.monitoring.serviceMonitor.enabled }}
- namespaceSelector: {}
  podSelector:
    matchLabels: {app.kubernetes.io/name: prometheus}
{{- else }}
[]
{{- end }}
{{- end }}
