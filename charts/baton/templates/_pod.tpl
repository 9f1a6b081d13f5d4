{{/* The pod template shared by router, prefill, decode and planner: call with (dict "root" $
"component" NAME "block" BLOCK "args" LIST "ports" LIST "env" LIST "probes" YAML "mounts" LIST
"volumes" LIST "serviceAccountName" NAME "automountToken" BOOL), and optionally
"annotations" DICT (checksums), "initContainers" LIST (the chart's own, before the block's),
"affinity" DICT (instead of the block's), "drain" BOOL (preStop sleep + grace period). A
block's own podSecurityContext / securityContext, when set, replaces the top-level one. */}}
{{- define "baton.podTemplate" -}}
{{- $root := .root }}
{{- $b := .block }}
{{- $selector := include "baton.selectorLabels" . | fromYaml }}
{{- $annotations := merge (deepCopy (.annotations | default dict)) ($b.podAnnotations | default dict) }}
{{- $securityContext := $b.securityContext | default $root.Values.securityContext }}
{{- $claims := list }}
{{- range ($b.resourceClaims | default list) }}{{ $claims = append $claims .name }}{{ end }}
{{- range (($b.resources | default dict).claims | default list) }}
{{- if not (has .name $claims) }}
{{- fail (printf "%s.resources.claims: %q is not one of %s.resourceClaims (a container claim needs the pod's PodResourceClaim)" $.component .name $.component) }}
{{- end }}
{{- end -}}
metadata:
  labels:
    {{- include "baton.selectorLabels" . | nindent 4 }}
    {{- range $key, $value := $b.podLabels }}
    {{- if not (hasKey $selector $key) }}
    {{ $key }}: {{ $value | quote }}
    {{- end }}
    {{- end }}
  {{- with $annotations }}
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
    {{- toYaml ($b.podSecurityContext | default $root.Values.podSecurityContext) | nindent 4 }}
  {{- with $b.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
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
  {{- if .drain }}
  terminationGracePeriodSeconds: {{ include "baton.gracePeriod" $root }}
  {{- end }}
  {{- with $b.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $b.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (hasKey . "affinity" | ternary .affinity $b.affinity) }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $b.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- range . }}
    - {{- toYaml (merge (dict) . (dict "labelSelector" (dict "matchLabels" $selector))) | nindent 6 }}
    {{- end }}
  {{- end }}
  {{- with $b.resourceClaims }}
  resourceClaims:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with concat (.initContainers | default list) ($b.initContainers | default list) }}
  initContainers:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .component }}
      image: {{ include "baton.image" . }}
      imagePullPolicy: {{ include "baton.pullPolicy" . }}
      command: [baton]
      args:
        {{- toYaml (concat .args ($b.extraArgs | default list)) | nindent 8 }}
      {{- with .ports }}
      ports:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        - {name: HOME, value: /tmp}
        - {name: XDG_CACHE_HOME, value: /cache}
        {{- with concat .env ($b.env | default list) }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .probes }}
      {{- . | nindent 6 }}
      {{- end }}
      {{- if and .drain $root.Values.drain.preStopSleepSeconds }}
      lifecycle:
        preStop:
          exec: {command: [sleep, {{ $root.Values.drain.preStopSleepSeconds | quote }}]}
      {{- end }}
      resources:
        {{- toYaml $b.resources | nindent 8 }}
      securityContext:
        {{- toYaml $securityContext | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
        - {name: cache, mountPath: /cache}
        {{- with concat (.mounts | default list) ($b.extraVolumeMounts | default list) }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: tmp
      emptyDir: {}
    - name: cache
      emptyDir: {sizeLimit: {{ $root.Values.cacheSizeLimit }}}
    {{- with concat (.volumes | default list) ($b.extraVolumes | default list) }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
