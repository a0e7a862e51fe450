{{/* Names and labels shared by every template. */}}
{{- define "trims.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "trims.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Selector labels of one component: include "trims.selector" (list . "daemon") */}}
{{- define "trims.selector" -}}
{{- $top := index . 0 -}}
app.kubernetes.io/name: trims
app.kubernetes.io/instance: {{ $top.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "trims.labels" -}}
{{ include "trims.selector" . }}
{{- $top := index . 0 }}
app.kubernetes.io/version: {{ $top.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $top.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" $top.Chart.Name $top.Chart.Version }}
{{- end -}}

{{/* Container security context of every trims container. */}}
{{- define "trims.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "trims.podSecurity" -}}
runAsNonRoot: true
runAsUser: {{ .Values.runAsUser }}
runAsGroup: {{ .Values.runAsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}
