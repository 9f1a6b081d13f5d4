{{/* Secrets: what the pods read from them (always as env from secretKeyRef or a mounted
file, never in args, never printed). */}}

{{/* A generated secret value (base64) kept across upgrades: the value already in the
cluster when the Secret exists (helm upgrade), else a new random one. Call with (dict "root"
$ "name" SECRET "key" KEY "length" N). `helm template` has no cluster: always new. */}}
{{- define "baton.keptSecretValue" -}}
{{- $found := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- if and $found $found.data (hasKey $found.data .key) }}
{{- index $found.data .key }}
{{- else }}
{{- randAlphaNum (int .length) | b64enc }}
{{- end }}
{{- end }}

{{/* The internal token's Secret and key. */}}
{{- define "baton.internalTokenRef" -}}
name: {{ .Values.internalToken.existingSecret | default (printf "%s-internal" (include "baton.fullname" .)) }}
key: {{ .Values.internalToken.key }}
{{- end }}

{{/* The in-chart Redis's password Secret and key. */}}
{{- define "baton.redisPasswordRef" -}}
name: {{ .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "baton.fullname" .)) }}
key: {{ .Values.redis.auth.key }}
{{- end }}

{{/* An external Redis's URL Secret and key. */}}
{{- define "baton.redisUrlRef" -}}
{{- $x := .Values.redis.external }}
{{- if and $x.existingSecret $x.url }}
{{- fail "redis.external: set existingSecret or url, not both" }}
{{- else if $x.existingSecret }}
name: {{ $x.existingSecret }}
key: {{ $x.key }}
{{- else if $x.url }}
name: {{ include "baton.fullname" . }}-registry
key: {{ $x.key }}
{{- else }}
{{- fail "redis.external.existingSecret (or redis.external.url) is required when redis.enabled is false" }}
{{- end }}
{{- end }}

{{/* $BATON_REDIS_URL for the router and the workers: the in-chart Redis's URL built by
kubelet from the password variable (the pod spec holds no secret), or an external URL
from its Secret. */}}
{{- define "baton.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: BATON_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      {{- include "baton.redisPasswordRef" . | nindent 6 }}
- name: BATON_REDIS_URL
  value: redis://:$(BATON_REDIS_PASSWORD)@{{ include "baton.fullname" . }}-redis:6379/0
{{- else }}
- name: BATON_REDIS_URL
  valueFrom:
    secretKeyRef:
      {{- include "baton.redisUrlRef" . | nindent 6 }}
{{- end }}
{{- end }}

{{/* $BATON_INTERNAL_TOKEN for the router and the workers; $BATON_API_KEY when clients
need a key (workers too: their /v1 is then not open either). */}}
{{- define "baton.authEnv" -}}
- name: BATON_INTERNAL_TOKEN
  valueFrom:
    secretKeyRef:
      {{- include "baton.internalTokenRef" . | nindent 6 }}
{{- if include "baton.apiKeyEnabled" . }}
- name: BATON_API_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "baton.apiKeySecret" . }}, key: {{ .Values.router.apiKey.key }}}
{{- end }}
{{- end }}
