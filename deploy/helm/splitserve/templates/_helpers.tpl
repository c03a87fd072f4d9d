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

{{/* The pod's volumes: the one holding the user's model (modelVolume), if any. */}}
{{- define "splitserve.volumes" -}}
{{- with .Values.modelVolume -}}
{{- if and .claimName .hostPath -}}
{{- fail "modelVolume: set claimName or hostPath, not both" -}}
{{- else if .claimName -}}
{{- toYaml (list (dict "name" "model" "persistentVolumeClaim" (dict "claimName" .claimName "readOnly" .readOnly))) -}}
{{- else if .hostPath -}}
{{- toYaml (list (dict "name" "model" "hostPath" (dict "path" .hostPath "type" "Directory"))) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
env, envFrom and volumeMounts of a splitserve container: the chart's own (the Redis password
on the head, HF_HOME, HF_TOKEN, the model volume), then the release's env / envFrom, then the
group's (of two env entries with one name, Kubernetes keeps the later).
Arguments: root (the chart's context), group (the head, prefill or decode values), head (bool).
*/}}
{{- define "splitserve.containerEnv" -}}
{{- $v := .root.Values -}}
{{- $env := list -}}
{{- if .head -}}
{{- with include "splitserve.redisSecretName" .root -}}
{{- $env = append $env (dict "name" "SPLITSERVE_REDIS_PASSWORD" "valueFrom" (dict "secretKeyRef" (dict "name" . "key" "password"))) -}}
{{- end -}}
{{- end -}}
{{- with $v.huggingface.home -}}
{{- $env = append $env (dict "name" "HF_HOME" "value" .) -}}
{{- end -}}
{{- with $v.huggingface.tokenSecret -}}
{{- if .name -}}
{{- $env = append $env (dict "name" "HF_TOKEN" "valueFrom" (dict "secretKeyRef" (dict "name" .name "key" .key))) -}}
{{- end -}}
{{- end -}}
{{- $out := dict -}}
{{- with concat $env $v.env .group.env -}}
{{- $_ := set $out "env" . -}}
{{- end -}}
{{- with concat $v.envFrom .group.envFrom -}}
{{- $_ := set $out "envFrom" . -}}
{{- end -}}
{{- if include "splitserve.volumes" .root -}}
{{- $_ := set $out "volumeMounts" (list (dict "name" "model" "mountPath" $v.modelVolume.mountPath "readOnly" $v.modelVolume.readOnly)) -}}
{{- end -}}
{{- with $out -}}
{{- toYaml . -}}
{{- end -}}
{{- end -}}

{{/* The head container's command: start Ray's head, then the cluster on it. */}}
{{- define "splitserve.headCommand" -}}
{{- $v := .Values -}}
ray start --head --dashboard-host=0.0.0.0 --num-cpus=0 --disable-usage-stats
&& exec splitserve up --ray-address=auto --host=0.0.0.0
--port={{ $v.service.port }}
--num-prefill-workers={{ $v.prefill.replicas }}
--num-decode-workers={{ $v.decode.replicas }}
--prefill-num-gpus={{ $v.prefill.numGpus }}
--decode-num-gpus={{ $v.decode.numGpus }}
--router-metrics-port={{ $v.metrics.port }}
--worker-metrics-port={{ $v.metrics.port }}
--kuberay-cluster={{ include "splitserve.fullname" . }}
--kuberay-namespace={{ .Release.Namespace }}
--redis-url={{ include "splitserve.shellQuote" (include "splitserve.redisUrl" .) }}
{{- include "splitserve.flags" $v.engine }}
{{- include "splitserve.flags" $v.worker }}
{{- include "splitserve.flags" $v.router }}
{{- include "splitserve.flags" $v.cluster }}
{{- include "splitserve.flags" $v.planner }}
{{- include "splitserve.flags" $v.redisOptions }}
{{- range $v.extraArgs }} {{ include "splitserve.shellQuote" . }}{{ end }}
{{- end -}}
