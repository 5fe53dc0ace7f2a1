{{- define "runcell.fullname" -}}
{{ .Release.Name }}-runcell
{{- end -}}

{{- define "runcell.etcdName" -}}
{{ .Release.Name }}-etcd
{{- end -}}

{{- define "runcell.etcdInitialCluster" -}}
{{- $name := include "runcell.etcdName" . -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- if $i }},{{ end }}{{ $name }}-{{ $i }}=http://{{ $name }}-{{ $i }}.{{ $name }}-peer:2380
{{- end -}}
{{- end -}}
