{{/* Combinations of values the schema cannot express; each `fail` names the fields. */}}
{{- define "baton.validate" -}}
{{- $v := .Values }}
{{- /* Who owns a pool's replicas: Helm, the planner or one autoscaler, never two. */}}
{{- range $role := list "prefill" "decode" }}
{{- $a := (index $v $role).autoscaling }}
{{- if and $v.planner.enabled $a.kind }}
{{- fail (printf "%s.autoscaling.kind=%s with planner.enabled: the planner already scales %s; turn one off" $role $a.kind $role) }}
{{- end }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "%s.autoscaling: minReplicas %d > maxReplicas %d" $role (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- if and (eq $a.kind "keda") (not $a.keda.serverAddress) }}
{{- fail (printf "%s.autoscaling.keda.serverAddress (the Prometheus URL) is required with kind keda" $role) }}
{{- end }}
{{- if and (eq $a.kind "hpa") (lt (int $a.minReplicas) 1) }}
{{- fail (printf "%s.autoscaling.minReplicas must be >= 1 with kind hpa (a HorizontalPodAutoscaler does not scale to zero; KEDA does)" $role) }}
{{- end }}
{{- if and (eq $a.kind "hpa") (not $a.hpa.metricName) }}
{{- fail (printf "%s.autoscaling.hpa.metricName (the External metric your adapter serves) is required with kind hpa" $role) }}
{{- end }}
{{- end }}
{{- if and $v.planner.enabled (not (and $v.prefill.enabled $v.decode.enabled)) }}
{{- fail "planner.enabled needs prefill.enabled and decode.enabled: it sizes both pools" }}
{{- end }}
{{- if and $v.colocation.mode (not (and $v.prefill.enabled $v.decode.enabled)) }}
{{- fail "colocation.mode places decode pods near prefill pods: it needs both pools enabled" }}
{{- end }}
{{- /* Host-network pods share the node's ports: every port of every host-network pool must
be distinct, or the scheduler fits one pod per node and the others stay Pending. */}}
{{- $seen := dict }}
{{- range $block := list "router" "prefill" "decode" }}
{{- $b := index $v $block }}
{{- if and $b.hostNetwork (or (eq $block "router") $b.enabled) }}
{{- $ports := list (printf "%s.port" $block) (int $b.port) }}
{{- if ne $block "router" }}{{ $ports = concat $ports (list (printf "%s.engine.kvPort" $block) (int $b.engine.kvPort)) }}{{ end }}
{{- range $i, $_ := until (div (len $ports) 2 | int) }}
{{- $field := index $ports (mul $i 2) }}
{{- $port := toString (index $ports (add (mul $i 2) 1)) }}
{{- if hasKey $seen $port }}
{{- fail (printf "%s and %s are both %s with hostNetwork: host-network pods share the node's ports; give each its own" (index $seen $port) $field $port) }}
{{- end }}
{{- $_ := set $seen $port $field }}
{{- end }}
{{- end }}
{{- end }}
{{- with $v.gateway.inferencePool }}
{{- if and .enabled (not .endpointPicker.name) }}
{{- fail "gateway.inferencePool.endpointPicker.name is required with the InferencePool (Baton's router is its member, not an endpoint picker)" }}
{{- end }}
{{- if and .enabled (not $v.gateway.httpRoute.enabled) }}
{{- fail "gateway.inferencePool.enabled needs gateway.httpRoute.enabled: the route is what sends traffic to the pool" }}
{{- end }}
{{- end }}
{{- if and $v.gateway.httpRoute.enabled (not $v.gateway.httpRoute.parentRefs) }}
{{- fail "gateway.httpRoute.parentRefs: name the Gateway the route attaches to" }}
{{- end }}
{{- end }}

{{/* A decode pod's affinity: its block's, plus the colocation rule toward the release's
prefill pods (same node, or same fabric domain by colocation.topologyKey). Call with (dict
"root" $ "role" ROLE); YAML of a map. */}}
{{- define "baton.workerAffinity" -}}
{{- $b := index .root.Values .role }}
{{- $affinity := deepCopy ($b.affinity | default dict) }}
{{- $c := .root.Values.colocation }}
{{- if and $c.mode (eq .role "decode") }}
{{- $prefill := include "baton.selectorLabels" (dict "root" .root "component" "prefill") | fromYaml }}
{{- $term := dict "topologyKey" $c.topologyKey "labelSelector" (dict "matchLabels" $prefill) }}
{{- $pod := $affinity.podAffinity | default dict }}
{{- if eq $c.mode "required" }}
{{- $_ := set $pod "requiredDuringSchedulingIgnoredDuringExecution" (append ($pod.requiredDuringSchedulingIgnoredDuringExecution | default list) $term) }}
{{- else }}
{{- $_ := set $pod "preferredDuringSchedulingIgnoredDuringExecution" (append ($pod.preferredDuringSchedulingIgnoredDuringExecution | default list) (dict "weight" (int $c.weight) "podAffinityTerm" $term)) }}
{{- end }}
{{- $_ := set $affinity "podAffinity" $pod }}
{{- end }}
{{- toYaml $affinity }}
{{- end }}
