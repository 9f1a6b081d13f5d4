{{/* Names ------------------------------------------------------------------------------ */}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object's name: the release name, plus the chart name unless the
release name already contains it. Component suffixes are at most 8 characters. */}}
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

{{/* Peers of this release that may call workers and Redis (router, workers, planner). */}}
{{- define "baton.releasePeers" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "baton.name" . }}
      app.kubernetes.io/instance: {{ .Release.Name }}
    matchExpressions:
      - {key: app.kubernetes.io/component, operator: In, values: [router, prefill, decode, planner]}
{{- end }}

{{/* Values derived from several places ------------------------------------------------- */}}
{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "baton.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The registry the router reads and workers register in. */}}
{{- define "baton.registryUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s-redis:6379/0" (include "baton.fullname" .) }}
{{- else if .Values.redis.external.url }}
{{- .Values.redis.external.url }}
{{- else }}
{{- fail "redis.external.url is required when redis.enabled is false" }}
{{- end }}
{{- end }}

{{- define "baton.apiKeySecret" -}}
{{- .Values.router.apiKey.existingSecret | default (printf "%s-api-key" (include "baton.fullname" .)) }}
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

{{/* The pod template shared by router, prefill, decode and planner: call with (dict "root" $
"component" NAME "block" BLOCK "args" LIST "ports" LIST "env" LIST "probes" YAML "mounts" LIST
"volumes" LIST "serviceAccountName" NAME "automountToken" BOOL). */}}
{{- define "baton.podTemplate" -}}
{{- $root := .root }}
{{- $b := .block -}}
metadata:
  labels:
    {{- include "baton.selectorLabels" . | nindent 4 }}
  {{- with $b.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ .serviceAccountName }}
  automountServiceAccountToken: {{ .automountToken | default false }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- if $b.hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  {{- if $b.hostIPC }}
  hostIPC: true
  {{- end }}
  {{- with $b.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $b.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $b.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $b.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .component }}
      image: {{ include "baton.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: [baton]
      args:
        {{- toYaml (concat .args $b.extraArgs) | nindent 8 }}
      {{- with .ports }}
      ports:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        - {name: HOME, value: /tmp}
        - {name: XDG_CACHE_HOME, value: /cache}
        {{- with concat .env $b.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .probes }}
      {{- . | nindent 6 }}
      {{- end }}
      resources:
        {{- toYaml $b.resources | nindent 8 }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
        - {name: cache, mountPath: /cache}
        {{- with .mounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    - name: cache
      emptyDir: {sizeLimit: {{ $root.Values.cacheSizeLimit }}}
    {{- with .volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* HTTP probes of the router and the workers. */}}
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

{{/* The model weights volume (read-only), when model.volume names one; else nothing. */}}
{{- define "baton.modelVolume" -}}
{{- $v := .Values.model.volume }}
{{- if and $v.claimName $v.hostPath }}
{{- fail "model.volume: set claimName or hostPath, not both" }}
{{- else if $v.claimName }}
- name: model
  persistentVolumeClaim: {claimName: {{ $v.claimName }}, readOnly: true}
{{- else if $v.hostPath }}
- name: model
  hostPath: {path: {{ $v.hostPath }}, type: Directory}
{{- else }}
[]
{{- end }}
{{- end }}

{{- define "baton.modelMount" -}}
{{- if or .Values.model.volume.claimName .Values.model.volume.hostPath }}
- {name: model, mountPath: {{ .Values.model.volume.mountPath }}, readOnly: true}
{{- else }}
[]
{{- end }}
{{- end }}
