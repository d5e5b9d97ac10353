{{- define "zerolayer.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "zerolayer.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: zerolayer
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "zerolayer.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "zerolayer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "zerolayer.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /* Runtimes get their own namespace by default: nothing of the operator's lives where runtime
pods (which run model code on untrusted prompts) run. */ -}}
{{- define "zerolayer.runtimeNamespace" -}}
{{- default (printf "%s-runtime" .Release.Namespace | trunc 63 | trimSuffix "-") .Values.runtime.namespace -}}
{{- end -}}

{{- define "zerolayer.image" -}}
{{- printf "%s:%s" .image.repository (default (printf "%s-gpu" .chart.AppVersion) .image.tag) -}}
{{- end -}}
