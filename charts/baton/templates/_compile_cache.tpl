{{/* Triton's compile cache (TRITON_CACHE_DIR) of the GPU worker pools. The first launch of
each Triton kernel compiles it (seconds per kernel, a dozen kernels at start-up); with the
cache on a volume that outlives the container, a restarted worker loads them instead. A pool
is a GPU pool when its resources ask for nvidia.com/gpu or its engine runs on cuda. Where the
cache lives is `tritonCache.type`:
  auto      the model's own writable claim when the chart has one (hf:// with
            `model.storage.create` or `existingClaim`), under `tritonCache.subPath`; else the
            pod's /cache volume (/cache/triton: kept across container restarts, not new pods)
  pvc       the claim `tritonCache.claimName`, under `tritonCache.subPath`
  hostPath  the node's directory `tritonCache.hostPath` (writable by uid 10001)
  emptyDir  /cache/triton on the pod's /cache volume
Triton keys its entries by kernel source, GPU architecture and Triton version, so one cache
is safe to share between pods and GPU kinds. Call each with (dict "root" $ "role" ROLE). */}}

{{- define "baton.gpuPool" -}}
{{- $b := index .root.Values .role }}
{{- $res := $b.resources | default dict }}
{{- $gpu := or (hasKey ($res.limits | default dict) "nvidia.com/gpu")
               (hasKey ($res.requests | default dict) "nvidia.com/gpu") }}
{{- if or $gpu (eq (toString (($b.engine | default dict).device | default "")) "cuda") }}true{{ end }}
{{- end }}

{{/* "volume" (a volume of its own, mounted at /triton-cache) or "cache" (/cache/triton). */}}
{{- define "baton.tritonCacheKind" -}}
{{- $c := .root.Values.tritonCache }}
{{- $type := $c.type | default "auto" }}
{{- if not (has $type (list "auto" "pvc" "hostPath" "emptyDir")) }}
{{- fail (printf "tritonCache.type: %q; expected auto, pvc, hostPath or emptyDir" $type) }}
{{- else if and (eq $type "pvc") (not $c.claimName) }}
{{- fail "tritonCache.type pvc needs tritonCache.claimName" }}
{{- else if and (eq $type "hostPath") (not $c.hostPath) }}
{{- fail "tritonCache.type hostPath needs tritonCache.hostPath" }}
{{- end }}
{{- if eq $type "auto" }}
{{- if and (eq (include "baton.modelKind" .root) "hf") (include "baton.modelClaim" .root) }}model{{ else }}cache{{ end }}
{{- else if eq $type "emptyDir" }}cache
{{- else }}volume
{{- end }}
{{- end }}

{{- define "baton.tritonCacheEnv" -}}
{{- if include "baton.gpuPool" . }}
{{- $kind := include "baton.tritonCacheKind" . }}
- {name: TRITON_CACHE_DIR, value: {{ eq $kind "cache" | ternary "/cache/triton" "/triton-cache" }}}
{{- else }}
[]
{{- end }}
{{- end }}

{{- define "baton.tritonCacheMounts" -}}
{{- $kind := include "baton.tritonCacheKind" . }}
{{- $c := .root.Values.tritonCache }}
{{- if and (include "baton.gpuPool" .) (ne $kind "cache") }}
{{- if eq $kind "model" }}
- {name: model, mountPath: /triton-cache, subPath: {{ $c.subPath | default "triton" }}}
{{- else if eq $c.type "pvc" }}
- {name: triton-cache, mountPath: /triton-cache, subPath: {{ $c.subPath | default "triton" }}}
{{- else }}
- {name: triton-cache, mountPath: /triton-cache}
{{- end }}
{{- else }}
[]
{{- end }}
{{- end }}

{{- define "baton.tritonCacheVolumes" -}}
{{- $c := .root.Values.tritonCache }}
{{- if and (include "baton.gpuPool" .) (eq (include "baton.tritonCacheKind" .) "volume") }}
- name: triton-cache
  {{- if eq $c.type "pvc" }}
  persistentVolumeClaim: {claimName: {{ $c.claimName }}}
  {{- else }}
  hostPath: {path: {{ $c.hostPath }}, type: DirectoryOrCreate}
  {{- end }}
{{- else }}
[]
{{- end }}
{{- end }}
