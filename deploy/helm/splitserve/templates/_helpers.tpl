{{- define "splitserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "splitserve.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "splitserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ .Values.serviceAccount.name | default (include "splitserve.fullname" .) }}
{{- else -}}
{{ .Values.serviceAccount.name | default "default" }}
{{- end -}}
{{- end -}}

{{- define "splitserve.redisSecretName" -}}
{{- if .Values.redis.enabled -}}
{{ .Values.redis.existingSecret | default (printf "%s-redis" (include "splitserve.fullname" .)) }}
{{- else -}}
{{ .Values.redis.external.existingSecret }}
{{- end -}}
{{- end -}}

{{- define "splitserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "splitserve.fullname" . }}-redis:6379/0
{{- else -}}
{{ required "redis.external.url is required when redis.enabled is false" .Values.redis.external.url }}
{{- end -}}
{{- end -}}

{{/* One shell word, whatever the characters (a ' inside ends, escapes and reopens the quote). */}}
{{- define "splitserve.shellQuote" -}}
'{{ . | toString | replace "'" "'\\''" }}'
{{- end -}}

{{/*
One flag per key of a values map: camelCase key -> --kebab-case flag; booleans become
--flag / --no-flag; null leaves the flag out. Output: one shell-quoted argument per flag.
YAML numbers arrive as float64, which prints 4194304 as 4.194304e+06: whole ones print as
integers.
*/}}
{{- define "splitserve.flags" -}}
{{- range $key, $value := . -}}
{{- if kindIs "bool" $value -}}
{{- if $value }} --{{ kebabcase $key }}{{ else }} --no-{{ kebabcase $key }}{{ end -}}
{{- else if and (kindIs "float64" $value) (eq $value (floor $value)) }} --{{ kebabcase $key }}={{ include "splitserve.shellQuote" (int64 $value) }}
{{- else if not (kindIs "invalid" $value) }} --{{ kebabcase $key }}={{ include "splitserve.shellQuote" $value }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The TLS identities whose Secrets a group's pods mount (head: router and controller). */}}
{{- define "splitserve.tlsIdentities" -}}
{{- if eq . "head" -}}router controller{{- else -}}{{ . }}{{- end -}}
{{- end -}}

{{- define "splitserve.tlsSecretName" -}}
{{- $secrets := .root.Values.security.tls.secrets -}}
{{- index $secrets .identity | default (printf "%s-tls-%s" (include "splitserve.fullname" .root) .identity) -}}
{{- end -}}

{{/*
A group's volumes and its container's mounts, as YAML {volumes: [...], mounts: [...]}: the user's
model (modelVolume), a writable /tmp (the root filesystem is read-only), the workers' KV tier
directory (kvOffloadVolume, prefill and decode only), the group's TLS Secrets
under /etc/splitserve/tls/<identity>, an external Redis's TLS Secret under
/etc/splitserve/redis-tls, and the API key file on the head.
Arguments: root (the chart's context), group ("head", "prefill" or "decode").
*/}}
{{- define "splitserve.storage" -}}
{{- $v := .root.Values -}}
{{- $volumes := list -}}
{{- $mounts := list -}}
{{- with $v.modelVolume -}}
{{- if and .claimName .hostPath -}}
{{- fail "modelVolume: set claimName or hostPath, not both" -}}
{{- else if .claimName -}}
{{- $volumes = append $volumes (dict "name" "model" "persistentVolumeClaim" (dict "claimName" .claimName "readOnly" .readOnly)) -}}
{{- else if .hostPath -}}
{{- $volumes = append $volumes (dict "name" "model" "hostPath" (dict "path" .hostPath "type" "Directory")) -}}
{{- end -}}
{{- if or .claimName .hostPath -}}
{{- $mounts = append $mounts (dict "name" "model" "mountPath" .mountPath "readOnly" .readOnly) -}}
{{- end -}}
{{- end -}}
{{- $volumes = append $volumes (dict "name" "tmp" "emptyDir" dict) -}}
{{- $mounts = append $mounts (dict "name" "tmp" "mountPath" "/tmp") -}}
{{- with $v.kvOffloadVolume.hostPath -}}
{{- if not $v.engine.kvOffloadDir -}}
{{- fail "kvOffloadVolume.hostPath: set engine.kvOffloadDir, where the workers see it" -}}
{{- end -}}
{{- if ne $.group "head" -}}
{{- $volumes = append $volumes (dict "name" "kv-offload" "hostPath" (dict "path" . "type" "DirectoryOrCreate")) -}}
{{- $mounts = append $mounts (dict "name" "kv-offload" "mountPath" $v.engine.kvOffloadDir) -}}
{{- end -}}
{{- end -}}
{{- if $v.security.tls.enabled -}}
{{- range $identity := splitList " " (include "splitserve.tlsIdentities" $.group) -}}
{{- $secret := include "splitserve.tlsSecretName" (dict "root" $.root "identity" $identity) -}}
{{- $volumes = append $volumes (dict "name" (printf "tls-%s" $identity) "secret" (dict "secretName" $secret "defaultMode" 288)) -}}
{{- $mounts = append $mounts (dict "name" (printf "tls-%s" $identity) "mountPath" (printf "/etc/splitserve/tls/%s" $identity) "readOnly" true) -}}
{{- end -}}
{{- end -}}
{{- if and (not $v.redis.enabled) $v.redis.external.tlsSecret -}}
{{- $volumes = append $volumes (dict "name" "redis-tls" "secret" (dict "secretName" $v.redis.external.tlsSecret "defaultMode" 288)) -}}
{{- $mounts = append $mounts (dict "name" "redis-tls" "mountPath" "/etc/splitserve/redis-tls" "readOnly" true) -}}
{{- end -}}
{{- if and (eq .group "head") $v.security.apiKeysSecret -}}
{{- $volumes = append $volumes (dict "name" "api-keys" "secret" (dict "secretName" $v.security.apiKeysSecret "defaultMode" 288 "items" (list (dict "key" "api-keys" "path" "api-keys")))) -}}
{{- $mounts = append $mounts (dict "name" "api-keys" "mountPath" "/etc/splitserve/api-keys" "readOnly" true) -}}
{{- end -}}
{{- toYaml (dict "volumes" $volumes "mounts" $mounts) -}}
{{- end -}}

{{/*
env, envFrom, volumeMounts and securityContext of a splitserve container: the chart's own (the
Redis password on the head, Ray's token, XDG_CACHE_HOME, HF_HOME, HF_TOKEN), then the release's
env / envFrom, then the group's (of two env entries with one name, Kubernetes keeps the later).
Arguments: root (the chart's context), group (the head, prefill or decode values), head (bool),
name ("head", "prefill" or "decode").
*/}}
{{- define "splitserve.containerEnv" -}}
{{- $v := .root.Values -}}
{{- $env := list -}}
{{- if .head -}}
{{- with include "splitserve.redisSecretName" .root -}}
{{- $env = append $env (dict "name" "SPLITSERVE_REDIS_PASSWORD" "valueFrom" (dict "secretKeyRef" (dict "name" . "key" "password"))) -}}
{{- end -}}
{{- end -}}
{{- if $v.security.rayAuth.enabled -}}
{{- $env = append $env (dict "name" "RAY_AUTH_MODE" "value" "token") -}}
{{- $env = append $env (dict "name" "RAY_AUTH_TOKEN" "valueFrom" (dict "secretKeyRef" (dict "name" (include "splitserve.rayAuthSecretName" .root) "key" "auth_token"))) -}}
{{- end -}}
{{- $env = append $env (dict "name" "XDG_CACHE_HOME" "value" "/tmp/cache") -}}
{{- $env = append $env (dict "name" "SPLITSERVE_LOG_LEVEL" "value" $v.logging.level) -}}
{{- $env = append $env (dict "name" "SPLITSERVE_LOG_FORMAT" "value" $v.logging.format) -}}
{{- with $v.huggingface.home -}}
{{- $env = append $env (dict "name" "HF_HOME" "value" .) -}}
{{- end -}}
{{- with $v.huggingface.tokenSecret -}}
{{- if .name -}}
{{- $env = append $env (dict "name" "HF_TOKEN" "valueFrom" (dict "secretKeyRef" (dict "name" .name "key" .key))) -}}
{{- end -}}
{{- end -}}
{{- $out := dict "env" (concat $env $v.env .group.env) -}}
{{- with concat $v.envFrom .group.envFrom -}}
{{- $_ := set $out "envFrom" . -}}
{{- end -}}
{{- $_ := set $out "volumeMounts" (include "splitserve.storage" (dict "root" .root "group" .name) | fromYaml).mounts -}}
{{- with $v.security.containerSecurityContext -}}
{{- $_ := set $out "securityContext" . -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{- define "splitserve.rayAuthSecretName" -}}
{{- .Values.security.rayAuth.existingSecret | default (printf "%s-ray-auth" (include "splitserve.fullname" .)) -}}
{{- end -}}

{{/*
The head container's probes, on the first router's HTTP API (router.http; values.yaml says why):
startup and liveness on /version (200 whenever the HTTP server runs), readiness on /health (200
only while a decode worker serves). HTTPS when the router serves TLS (the kubelet does not check
the certificate); neither path asks for an API key. They replace the Ray health probes KubeRay
injects into a container that has none: a dead raylet or GCS takes the router actors with it.
*/}}
{{- define "splitserve.headProbes" -}}
{{- $scheme := ternary "HTTPS" "HTTP" .Values.security.tls.enabled -}}
startupProbe:
  httpGet: {path: /version, port: http, scheme: {{ $scheme }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 60
livenessProbe:
  httpGet: {path: /version, port: http, scheme: {{ $scheme }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
readinessProbe:
  httpGet: {path: /health, port: http, scheme: {{ $scheme }}}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
{{- end -}}

{{/*
Fails when two of the head's port ranges overlap: each of cluster.numRouters routers takes the
next port of service.port (gRPC), router.httpPort (HTTP) and metrics.port. router.http and
router.httpPort may not be null (elsewhere: leave the flag out), as the Service needs them.
*/}}
{{- define "splitserve.checkHeadPorts" -}}
{{- if kindIs "invalid" .Values.router.http -}}
{{- fail "router.http must be true or false, not null" -}}
{{- end -}}
{{- if and .Values.router.http (kindIs "invalid" .Values.router.httpPort) -}}
{{- fail "router.httpPort must be a port, not null, while router.http is on" -}}
{{- end -}}
{{- $n := int .Values.cluster.numRouters -}}
{{- $bases := dict "service.port" (int .Values.service.port) "metrics.port" (int .Values.metrics.port) -}}
{{- if .Values.router.http -}}
{{- $_ := set $bases "router.httpPort" (int .Values.router.httpPort) -}}
{{- end -}}
{{- range $a, $p := $bases -}}
{{- range $b, $q := $bases -}}
{{- if and (lt $a $b) (lt $p (add $q $n)) (lt $q (add $p $n)) -}}
{{- fail (printf "%s (%d) and %s (%d): the ports of %d router(s) overlap" $a $p $b $q $n) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The head container's command: start Ray's head, then the cluster on it. */}}
{{- define "splitserve.headCommand" -}}
{{- $v := .Values -}}
ray start --head --dashboard-host=127.0.0.1 --num-cpus=0 --disable-usage-stats
&& exec splitserve up --ray-address=auto --host=0.0.0.0
--port={{ $v.service.port }}
--num-prefill-workers={{ $v.prefill.replicas }}
--num-decode-workers={{ $v.decode.replicas }}
--prefill-num-gpus={{ $v.prefill.numGpus }}
--decode-num-gpus={{ $v.decode.numGpus }}
{{- with $v.prefill.workerArgs }} --prefill-worker-args={{ include "splitserve.shellQuote" . }}{{ end }}
{{- with $v.decode.workerArgs }} --decode-worker-args={{ include "splitserve.shellQuote" . }}{{ end }}
{{- with $v.extraModels }} --extra-models={{ include "splitserve.shellQuote" (toJson .) }}{{ end }}
--router-metrics-port={{ $v.metrics.port }}
--worker-metrics-port={{ $v.metrics.port }}
--kuberay-cluster={{ include "splitserve.fullname" . }}
--kuberay-namespace={{ .Release.Namespace }}
--redis-url={{ include "splitserve.shellQuote" (include "splitserve.redisUrl" .) }}
{{- if $v.security.tls.enabled }} --tls-dir=/etc/splitserve/tls{{ end }}
{{- if $v.security.apiKeysSecret }} --api-key-file=/etc/splitserve/api-keys/api-keys{{ end }}
{{- if and (not $v.redis.enabled) $v.redis.external.tlsSecret (not $v.redisOptions.redisTlsCaFile) }} --redis-tls-ca-file=/etc/splitserve/redis-tls/ca.crt{{ end }}
{{- include "splitserve.flags" $v.engine }}
{{- include "splitserve.flags" $v.worker }}
{{- include "splitserve.flags" $v.router }}
{{- include "splitserve.flags" $v.cluster }}
{{- include "splitserve.flags" $v.planner }}
{{- include "splitserve.flags" $v.redisOptions }}
{{- include "splitserve.flags" $v.tracing }}
{{- range $v.extraArgs }} {{ include "splitserve.shellQuote" . }}{{ end }}
{{- end -}}

{{/* A worker group's replicas: its role's pool of engine.model and of every extraModels entry
(an entry without its size has the role's replicas). Takes (dict "root" . "role" role). */}}
{{- define "splitserve.groupReplicas" -}}
{{- $pool := index .root.Values .role -}}
{{- $total := int $pool.replicas -}}
{{- range .root.Values.extraModels -}}
{{- $size := index . (printf "num_%s_workers" $.role) -}}
{{- $total = add $total (kindIs "invalid" $size | ternary $pool.replicas $size) -}}
{{- end -}}
{{- $total -}}
{{- end -}}
