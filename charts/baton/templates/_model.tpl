{{/* Model artifacts (as llm-d's modelArtifacts.uri):
  ""                 the model bundled in the image (no volume, no --model)
  hf://ORG/NAME      an init container downloads the snapshot into `model.storage` (a PVC the
                     chart creates, an existing one, or an emptyDir), mounted at /models; the
                     engine reads the hub cache layout (--model hf://ORG/NAME@REVISION with
                     HF_HUB_CACHE=/models/hub, offline)
  pvc://CLAIM/PATH   the claim mounted read-only at /models; --model /models/PATH
  hostpath:///PATH   the node's directory (or .gguf file) mounted read-only under /models
Or, with uri "", a Hugging Face hub cache that already holds the model (`model.cache.pvc` or
`model.cache.hostPath`): `model.name` is its repo id (--model ORG/NAME --revision R, read
offline with HF_HUB_CACHE=/models/hub), the cache mounted read-only at /models/hub; with
`model.cache.initCopy` an init container first copies that one snapshot out of the cache into
a volume of the pod's own (an emptyDir or a claim), which the worker then reads. */}}

{{- define "baton.modelKind" -}}
{{- $uri := .Values.model.uri }}
{{- $c := .Values.model.cache }}
{{- if and $c.pvc $c.hostPath }}
{{- fail "model.cache: set pvc or hostPath, not both" }}
{{- else if and $uri (or $c.pvc $c.hostPath) }}
{{- fail (printf "model.cache is for a model named by its repo id (model.uri \"\"), not model.uri %q" $uri) }}
{{- end }}
{{- if or $c.pvc $c.hostPath }}
{{- if not (regexMatch "^[A-Za-z0-9][\\w.-]*/[A-Za-z0-9][\\w.-]*$" .Values.model.name) }}
{{- fail (printf "model.cache: model.name %q must be the model's repo id, ORG/NAME" .Values.model.name) }}
{{- end }}cache
{{- else if not $uri }}bundled
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
{{- else if eq $kind "cache" }}
{{- .Values.model.name }}
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
{{- else if eq $kind "cache" }}
{{- include "baton.modelCacheVolumes" . }}
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
{{- else if eq $kind "cache" }}
- {name: model, mountPath: /models/hub, readOnly: true}
{{- else if and (eq $kind "hostpath") (hasSuffix ".gguf" .Values.model.uri) }}
- {name: model, mountPath: {{ include "baton.modelArg" . }}, readOnly: true}
{{- else }}
- {name: model, mountPath: /models, readOnly: true}
{{- end }}
{{- end }}

{{- define "baton.modelEnv" -}}
{{- if has (include "baton.modelKind" .) (list "hf" "cache") }}
- {name: HF_HUB_CACHE, value: /models/hub}
- {name: HF_HUB_OFFLINE, value: "1"}
{{- else }}
[]
{{- end }}
{{- end }}

{{/* The hf:// LoRA adapters of the tuning file's worker.lora_modules, as a YAML list of
"ORG/NAME@REVISION" (revision main when the value pins none), sorted. They are downloaded
beside an hf:// model (into its volume, before the worker starts) or read from
`model.cache`; with any other model source the chart refuses them. */}}
{{- define "baton.loraHubRefs" -}}
{{- $refs := list }}
{{- range $name, $path := (.Values.tuning.worker.lora_modules | default dict) }}
{{- if hasPrefix "hf://" (toString $path) }}
{{- $body := trimPrefix "hf://" (toString $path) }}
{{- $refs = append $refs (contains "@" $body | ternary $body (printf "%s@main" $body)) }}
{{- end }}
{{- end }}
{{- if and $refs (not (has (include "baton.modelKind" .) (list "hf" "cache"))) }}
{{- fail "tuning.worker.lora_modules: hf:// adapters need model.uri hf://... (downloaded into its volume) or model.cache (read from it); put other adapters on a mounted volume and name their directory" }}
{{- end }}
{{- toYaml (sortAlpha $refs) }}
{{- end }}

{{/* The pods' annotation that rolls them when the hf:// adapters change (their downloads
run at a pod's start; adapters on volumes load and unload live, with no roll): a YAML map,
empty without such adapters. */}}
{{- define "baton.loraDownloadChecksum" -}}
{{- $refs := include "baton.loraHubRefs" . | fromYamlArray }}
{{- if $refs }}
checksum/lora-downloads: {{ toYaml $refs | sha256sum }}
{{- end }}
{{- end }}

{{/* The hf:// download, run before the worker by its own image (huggingface_hub is in it),
then one for each hf:// LoRA adapter; call with (dict "root" $ "block" BLOCK). */}}
{{- define "baton.modelInitContainers" -}}
{{- $root := .root }}
{{- $m := $root.Values.model }}
{{- $loras := include "baton.loraHubRefs" $root | fromYamlArray }}
{{- $ctx := . }}
{{- if eq (include "baton.modelKind" $root) "hf" }}
{{- range $i, $ref := prepend $loras (printf "%s@%s" (trimPrefix "hf://" $m.uri) $m.revision) }}
- name: {{ eq $i 0 | ternary "model-download" (printf "lora-download-%d" $i) }}
  image: {{ include "baton.image" $ctx }}
  imagePullPolicy: {{ include "baton.pullPolicy" $ctx }}
  command: [python, -m, baton.engine.models.hub]
  {{- $repo := splitList "@" $ref }}
  args: [download, {{ first $repo }}, --revision, {{ last $repo | quote }}, --cache-dir, /models/hub]
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
    {{- toYaml ($ctx.block.securityContext | default $root.Values.securityContext) | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    - {name: model, mountPath: /models}
{{- end }}
{{- else if and (eq (include "baton.modelKind" $root) "cache") $m.cache.initCopy.enabled }}
- name: model-copy
  image: {{ include "baton.image" . }}
  imagePullPolicy: {{ include "baton.pullPolicy" . }}
  command: [python, -m, baton.engine.models.hub]
  args: [copy, {{ $m.name }}, --revision, {{ $m.revision | quote }}, --from, /hf-source, --to, /models/hub]
  resources:
    {{- toYaml $m.downloadResources | nindent 4 }}
  securityContext:
    {{- toYaml (.block.securityContext | default $root.Values.securityContext) | nindent 4 }}
  volumeMounts:
    - {name: model-source, mountPath: /hf-source, readOnly: true}
    - {name: model, mountPath: /models/hub}
{{- else }}
[]
{{- end }}
{{- end }}

{{/* model.cache's volumes: `model` is what the worker reads (the cache itself, read-only;
or with initCopy the pod's own copy, an emptyDir or a claim) and `model-source` the cache
the copy reads. */}}
{{- define "baton.modelCacheVolumes" -}}
{{- $c := .Values.model.cache }}
{{- $name := $c.initCopy.enabled | ternary "model-source" "model" }}
- name: {{ $name }}
  {{- if $c.pvc }}
  persistentVolumeClaim: {claimName: {{ $c.pvc }}, readOnly: true}
  {{- else }}
  hostPath: {path: {{ $c.hostPath }}, type: Directory}
  {{- end }}
{{- if $c.initCopy.enabled }}
- name: model
  {{- with $c.initCopy.claim }}
  persistentVolumeClaim: {claimName: {{ . }}}
  {{- else }}
  emptyDir: {sizeLimit: {{ $c.initCopy.size }}}
  {{- end }}
{{- end }}
{{- end }}

{{/* `--revision` for a model named by its repo id; the served names (`model.name`, or
`model.servedModelNames`, the first reported in responses). */}}
{{- define "baton.modelArgs" -}}
{{- $m := .Values.model }}
{{- if eq (include "baton.modelKind" .) "cache" }}
- --revision
- {{ $m.revision | quote }}
{{- end }}
- --served-model-name
{{- range ($m.servedModelNames | default (list $m.name)) }}
- {{ . | quote }}
{{- end }}
{{- end }}
