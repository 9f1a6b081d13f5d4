{{/* Model artifacts (as llm-d's modelArtifacts.uri):
  ""                 the model bundled in the image (no volume, no --model)
  hf://ORG/NAME      an init container downloads the snapshot into `model.storage` (a PVC the
                     chart creates, an existing one, or an emptyDir), mounted at /models; the
                     engine reads the hub cache layout (--model hf://ORG/NAME@REVISION with
                     HF_HUB_CACHE=/models/hub, offline)
  pvc://CLAIM/PATH   the claim mounted read-only at /models; --model /models/PATH
  hostpath:///PATH   the node's directory (or .gguf file) mounted read-only under /models */}}

{{- define "baton.modelKind" -}}
{{- $uri := .Values.model.uri }}
{{- if not $uri }}bundled
{{- else if hasPrefix "hf://" $uri }}hf
{{- else if hasPrefix "pvc://" $uri }}pvc
{{- else if hasPrefix "hostpath://" $uri }}hostpath
{{- else }}{{ fail (printf "model.uri %q: expected hf://ORG/NAME, pvc://CLAIM/PATH or hostpath:///PATH" $uri) }}
{{- end }}
{{- end }}

{{- define "baton.modelClaim" -}}
{{- $s := .Values.model.storage }}
{{- if and $s.create $s.existingClaim }}
{{- fail "model.storage: set create or existingClaim, not both" }}
{{- end }}
{{- if $s.create }}{{ include "baton.fullname" . }}-models{{ else }}{{ $s.existingClaim }}{{ end }}
{{- end }}

{{/* The path inside the pod and the --model value ("" for the bundled model). */}}
{{- define "baton.modelArg" -}}
{{- $kind := include "baton.modelKind" . }}
{{- $uri := .Values.model.uri }}
{{- if eq $kind "hf" }}
{{- printf "%s@%s" $uri .Values.model.revision }}
{{- else if eq $kind "pvc" }}
{{- $rest := trimPrefix "pvc://" $uri }}
{{- $path := regexReplaceAll "^[^/]*/?" $rest "" }}
{{- printf "/models/%s" $path | trimSuffix "/" }}
{{- else if eq $kind "hostpath" }}
{{- $path := trimPrefix "hostpath://" $uri }}
{{- if hasSuffix ".gguf" $path }}/models/{{ base $path }}{{ else }}/models{{ end }}
{{- end }}
{{- end }}

{{- define "baton.modelVolumes" -}}
{{- $kind := include "baton.modelKind" . }}
{{- $uri := .Values.model.uri }}
{{- if eq $kind "hf" }}
- name: model
  {{- with include "baton.modelClaim" . }}
  persistentVolumeClaim: {claimName: {{ . }}}
  {{- else }}
  emptyDir: {sizeLimit: {{ .Values.model.storage.size }}}
  {{- end }}
{{- else if eq $kind "pvc" }}
{{- $claim := regexFind "^[^/]+" (trimPrefix "pvc://" $uri) }}
- name: model
  persistentVolumeClaim: {claimName: {{ $claim }}, readOnly: true}
{{- else if eq $kind "hostpath" }}
{{- $path := trimPrefix "hostpath://" $uri }}
- name: model
  hostPath: {path: {{ $path }}, type: {{ hasSuffix ".gguf" $path | ternary "File" "Directory" }}}
{{- else }}
[]
{{- end }}
{{- end }}

{{- define "baton.modelMounts" -}}
{{- $kind := include "baton.modelKind" . }}
{{- if eq $kind "bundled" }}
[]
{{- else if and (eq $kind "hostpath") (hasSuffix ".gguf" .Values.model.uri) }}
- {name: model, mountPath: {{ include "baton.modelArg" . }}, readOnly: true}
{{- else }}
- {name: model, mountPath: /models, readOnly: true}
{{- end }}
{{- end }}

{{- define "baton.modelEnv" -}}
{{- if eq (include "baton.modelKind" .) "hf" }}
- {name: HF_HUB_CACHE, value: /models/hub}
- {name: HF_HUB_OFFLINE, value: "1"}
{{- else }}
[]
{{- end }}
{{- end }}

{{/* The hf:// download, run before the worker by its own image (huggingface_hub is in it);
call with (dict "root" $ "block" BLOCK). */}}
{{- define "baton.modelInitContainers" -}}
{{- $root := .root }}
{{- $m := $root.Values.model }}
{{- if eq (include "baton.modelKind" $root) "hf" }}
- name: model-download
  image: {{ include "baton.image" . }}
  imagePullPolicy: {{ include "baton.pullPolicy" . }}
  command: [python, -m, baton.engine.models.hub]
  args: [download, {{ trimPrefix "hf://" $m.uri }}, --revision, {{ $m.revision | quote }}, --cache-dir, /models/hub]
  env:
    - {name: HOME, value: /tmp}
    - {name: HF_HUB_DISABLE_TELEMETRY, value: "1"}
    {{- with $m.hfToken.existingSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ . }}, key: {{ $m.hfToken.key }}}
    {{- end }}
  resources:
    {{- toYaml $m.downloadResources | nindent 4 }}
  securityContext:
    {{- toYaml (.block.securityContext | default $root.Values.securityContext) | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    - {name: model, mountPath: /models}
{{- else }}
[]
{{- end }}
{{- end }}
