"""The table of settings: each one declared once, with which processes get it (see :mod:`.spec`).

launcher: ``pdserve serve`` (:class:`pdserve.launch.config.LauncherConfig`, its flags); router: ``python -m
pdserve.router`` (:class:`pdserve.router.config.RouterConfig`, its flags); conductor:
:class:`pdserve.conductor.config.ConductorConfig` (inside the router, or alone in the simulator); worker: the
vLLM workers (their argv, or pdserve's connector through ``kv_connector_extra_config``); pool: the KV pool's
master and node. A setting in the launcher and the router is written into the router's argv by the launcher
as its ``argv`` rule says; one the router hands to the conductor has a :class:`Target` (unit conversion
included). Compound launcher values (core lists, extra argv, env, connector_extra, GPU ids) and worker URL
lists are not simple values and stay in their configs.
"""

from __future__ import annotations

from typing import Any

from .spec import Setting, Target

POLICIES = ("round_robin", "least_loaded", "conductor")
BACKENDS = ("auto", "tcp", "local", "mooncake", "nixl")  # the transfer engine's data paths
KV_CONNECTORS = ("pdserve", "nixl", "mooncake")  # the workers' KV data plane: pdserve's, or vLLM's Nixl/Mooncake
MOONCAKE_PROTOCOLS = ("tcp", "rdma", "efa")  # vLLM MooncakeConnector's mooncake_protocol (efa: where Mooncake has it)
POOL_BACKENDS = ("pdserve", "mooncake")  # the KV pool: pdserve's store, or Mooncake Store through vLLM's connector
MOONCAKE_BOOTSTRAP_PORT = 8998  # vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default: P's bootstrap server on its host
DTYPES = ("auto", "bfloat16", "float", "float32", "half", "float16")
ROUTER_MODES = ("", "colocated", "disaggregated", "elastic")
EARLY_CONTINUE = ("auto", "always", "never")  # an early hand-off's first token: D continues after P's or regenerates it
TIER_PRICING = ("priced", "flat", "device")  # the conductor's pricing of a prefill's start (docs/conductor.md, "Tiers")
LEASE_MIN_S = 0.1
LEASE_MAX_S = 3600.0
MIN_BODY_BYTES = 4096  # room for any small request
MAX_BODY_BYTES = 1 << 30
DEFAULT_MAX_BODY_BYTES = 4 << 20

L, R, C, W, P = "launcher", "router", "conductor", "worker", "pool"
IX = "indexer"  # pdserve indexer (docs/indexer.md)
PK = "picker"  # pdserve picker (docs/picker.md)

_PORT = "use a TCP port 1-65535, or 0 to pick a free one"
_SECONDS = "use a positive number of seconds"
_COUNT = "use a whole number of workers >= 0"
_SLO = "a target in {unit} > 0, or unset for none (requests predicted to miss it get 429 + Retry-After)"

SETTINGS: tuple[Setting, ...] = (
    # ---------------------------------------------------------------- the launch: workers and their shape
    Setting("model", str, "", "Hugging Face model folder (default: SmolLM2-135M-Instruct, converted on first use)",
            (L,), metavar="DIR", group="workers"),
    Setting("prefill", int, None, "prefill workers (default 1)", (L,), minimum=0, optional=True, advice=_COUNT,
            metavar="N", group="workers"),
    Setting("decode", int, None, "decode workers (default 1)", (L,), minimum=0, optional=True, advice=_COUNT,
            metavar="M", group="workers"),
    Setting("colocated", int, 0, "run K plain workers instead (the colocated baseline)", (L,), minimum=0,
            advice=_COUNT, metavar="K", group="workers"),
    Setting("elastic", int, 0, "run N workers with no fixed role instead (all kv_both with pdserve's connector); "
            "the conductor runs each request colocated on one or split P -> D over two (default policy then: "
            "conductor)", (L,), minimum=0, metavar="N", group="workers",
            advice="use a whole number of workers >= 1 (0 turns elastic roles off)"),
    Setting("host", str, "127.0.0.1", "router address (bind)", (L, R), minimum=1, group="server",
            advice="an address such as 127.0.0.1"),
    Setting("port", int, 8000, "router port (0 = a free port)", (L, R), minimum=0, maximum=65535, advice=_PORT,
            group="server"),
    Setting("routers", int, 1, "router processes sharing the public port (SO_REUSEPORT; the kernel spreads "
            "connections); every one subscribes to every worker's KV events, shares run-time membership (the "
            "launch's membership file) and, above 1, counts the other routers' load from the workers' /metrics",
            (L, R), minimum=1, maximum=64, metavar="N", group="server", argv="changed",
            targets=(Target("conductor", "replicas", default=1),),
            advice="use a whole number of router processes from 1 to 64"),
    Setting("membership_file", str, "", "share run-time worker membership with the other router processes of "
            "this host through this JSON file (the launcher sets one in the run folder); a restarted router "
            "takes the set it holds", (R,), metavar="PATH", group="server", argv="set"),
    Setting("worker_host", str, "127.0.0.1", "address workers bind", (L,), minimum=1, group="workers",
            advice="an address such as 127.0.0.1"),
    Setting("cores_per_worker", int, 1, "cores per worker", (L,), minimum=1, group="workers",
            advice="use an integer >= 1"),
    Setting("kv_cache_gib", int, 1, "KV cache per worker in GiB (VLLM_CPU_KVCACHE_SPACE)", (L, W), unit="GiB",
            minimum=1, group="workers", advice="vLLM's CPU KV cache is sized in whole GiB (VLLM_CPU_KVCACHE_SPACE); "
            "use an integer >= 1"),
    Setting("served_model_name", str, "", "name clients use in 'model' (default: the model folder's name; router "
            "alone: --model-dir as given)", (L, W, R), optional=True, group="server", argv="always"),
    Setting("max_model_len", int, 2048, "context length: the workers' --max-model-len, and the limit (prompt + "
            "max_tokens) the router enforces (router alone: 0 = config.json's max_position_embeddings)",
            (L, W, R), unit="tokens", minimum=16, group="workers", argv="always", defaults=((R, 0),),
            advice="use an integer >= 16 (tokens)"),
    Setting("dtype", str, None, "model dtype for vLLM (default: bfloat16 where the CPU has AVX512-BF16 or AMX, "
            "else float32)", (L, W), choices=DTYPES, optional=True, group="workers",
            advice="unknown; choose one of " + str(DTYPES) + " (this CPU has no fast fp16: prefer bfloat16 or "
            "float32)"),
    Setting("connector", bool, None, "load pdserve's connector (--kv-connector) in every worker (default: on, "
            "off for --colocated)", (L, W), optional=True, flag="--connector", off_flag="--no-connector",
            group="workers"),
    Setting("lease_s", float, 30.0, "seconds a prefill worker holds KV for decode (pdserve's connector; "
            "NixlConnector's kv_lease_duration, rounded up)", (L, W), unit="s", minimum=LEASE_MIN_S,
            maximum=LEASE_MAX_S, group="workers",
            advice="seconds a prefill worker keeps KV for decode; use {lo} to {hi}"),
    Setting("gpus_per_worker", int, 1, "GPUs per worker (> 1 runs vLLM tensor-parallel)", (L,), minimum=1,
            group="gpus", advice="use an integer >= 1"),
    Setting("share_gpu", bool, False, "let several workers share a GPU, splitting --gpu-memory-utilization "
            "evenly", (L,), group="gpus"),
    Setting("gpu_memory_utilization", float, None, "fraction of each GPU's memory for vLLM (default vLLM's 0.9; "
            "split when shared)", (L, W), minimum=0, above=True, maximum=1, optional=True, group="gpus",
            advice="the fraction of a GPU's memory vLLM may use, in (0, 1], e.g. 0.9"),
    Setting("prefill_tp", int, 1, "tensor-parallel ranks per prefill worker (on CPU each rank gets "
            "--cores-per-worker cores; turns the KV pool off)", (L,), minimum=1, metavar="N", group="gpus",
            advice="use a whole number of tensor-parallel ranks >= 1 (vLLM's --tensor-parallel-size)"),
    Setting("decode_tp", int, 1, "tensor-parallel ranks per decode worker; may differ from --prefill-tp", (L,),
            minimum=1, metavar="N", group="gpus",
            advice="use a whole number of tensor-parallel ranks >= 1 (vLLM's --tensor-parallel-size)"),
    Setting("speculative_config", str, "", "vLLM's --speculative-config JSON for the workers that decode (decode, "
            "colocated, elastic), e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
            "\"prompt_lookup_max\": 4}'; a drafter with layers (eagle, mtp, a draft model) goes to prefill workers "
            "too, which compute its KV for the hand-off", (L, W), metavar="JSON", group="workers"),
    Setting("prefill_ep", bool, False, "prefill workers run their routed experts expert-parallel over their "
            "TP x DP ranks (vLLM's --enable-expert-parallel)", (L,), group="gpus"),
    Setting("decode_ep", bool, False, "decode workers run their routed experts expert-parallel over their TP x DP "
            "ranks (vLLM's --enable-expert-parallel): with --decode-dp, a wide-EP decode pool", (L,), group="gpus"),
    Setting("prefill_dp", int, 1, "data-parallel attention ranks per prefill worker (vLLM's --data-parallel-size; "
            "GPU workers: --gpus-per-worker = TP x DP)", (L,), minimum=1, metavar="N", group="gpus",
            advice="use a whole number of data-parallel ranks >= 1 (vLLM's --data-parallel-size)"),
    Setting("decode_dp", int, 1, "data-parallel attention ranks per decode worker (vLLM's --data-parallel-size; "
            "GPU workers: --gpus-per-worker = TP x DP)", (L,), minimum=1, metavar="N", group="gpus",
            advice="use a whole number of data-parallel ranks >= 1 (vLLM's --data-parallel-size)"),
    # ---------------------------------------------------------------- LoRA adapters (every worker loads them)
    Setting("lora_modules", str, "", "LoRA adapters every worker loads, as NAME=PATH,NAME=PATH (vLLM's "
            "--lora-modules; turns --enable-lora on); clients pick one with model=NAME, /v1/models lists them",
            (L, W, R), metavar="NAME=PATH,...", group="lora", argv="set",
            advice="give NAME=PATH pairs separated by commas, e.g. sql=/models/sql-lora"),
    Setting("enable_lora", bool, False, "serve LoRA adapters (vLLM's --enable-lora on every worker, with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True so /v1/load_lora_adapter reaches them); on with --lora-modules",
            (L, W, R), group="lora", argv="changed"),
    Setting("max_lora_rank", int, 16, "largest adapter rank the workers accept (vLLM's --max-lora-rank: 1, 8, 16, "
            "32, 64, 128, 256, 320 or 512)", (L, W), minimum=1, maximum=512, metavar="R", group="lora",
            advice="use one of vLLM's ranks 1, 8, 16, 32, 64, 128, 256, 320, 512"),
    Setting("max_loras", int, 4, "adapters one worker batch may mix (vLLM's --max-loras; each takes memory for "
            "its weights at the largest rank)", (L, W), minimum=1, maximum=256, metavar="N", group="lora",
            advice="use a whole number of adapters from 1 to 256"),
    Setting("run_dir", str, "", "folder for logs (default .pdserve/runs/<timestamp>-<pid>)", (L,), group="workers"),
    Setting("worker_timeout_s", float, 600.0, "seconds to wait for workers' /health", (L,), unit="s", minimum=0,
            above=True, flag="--worker-timeout", advice=_SECONDS, group="supervision"),
    Setting("router_timeout_s", float, 120.0, "seconds to wait for the router's /health", (L,), unit="s",
            minimum=0, above=True, flag="--router-timeout", advice=_SECONDS, group="supervision"),
    Setting("stop_timeout_s", float, 20.0, "seconds a process gets to exit after SIGTERM before SIGKILL", (L,),
            unit="s", minimum=0, above=True, on_cli=False, advice=_SECONDS, group="supervision"),
    # ---------------------------------------------------------------- placement (the router's conductor)
    Setting("policy", str, "round_robin", "placement: round_robin, least_loaded, or conductor (prefix-, load- and "
            "SLO-aware; the launcher then enables the workers' KV cache events)", (L, R, C), choices=POLICIES,
            group="placement", argv="always", targets=(Target("conductor", "policy", default="conductor"),),
            advice="choose one of " + ", ".join(POLICIES) + " (conductor: prefix-, load- and SLO-aware "
            "placement; the others are baselines)"),
    Setting("kv_events_bind", str, "", "one router only: bind this ZMQ endpoint for workers' KV events (e.g. "
            "tcp://127.0.0.1:5557); workers set --kv-events-config endpoint to it and topic to their own URL. "
            "The launcher instead has each worker bind its publisher and the routers subscribe (--kv-events)",
            (R,), metavar="ENDPOINT", group="placement", argv="set"),
    Setting("kv_events_port", int, 0, "subscribe to the KV events of every worker with no --kv-events entry (one "
            "discovery or the membership API added) at tcp://<its host>:PORT, replay at PORT+1 (its vLLM binds "
            "tcp://*:PORT; the chart does); 0: only the workers --kv-events names", (R, IX), minimum=0,
            maximum=65534, metavar="PORT", group="placement", advice="use a TCP port 1-65534, or 0 for none"),
    Setting("ttft_slo_ms", float, None, "conductor: reject (429) requests predicted to miss this TTFT",
            (L, R, C), unit="ms", minimum=0, above=True, optional=True, advice=_SLO, group="placement",
            argv="set", targets=(Target("conductor", "ttft_slo_s", 1000.0, "s"),)),
    Setting("tpot_slo_ms", float, None, "conductor: reject (429) requests predicted to miss this TPOT",
            (L, R, C), unit="ms", minimum=0, above=True, optional=True, advice=_SLO, group="placement",
            argv="set", targets=(Target("conductor", "tpot_slo_s", 1000.0, "s"),)),
    Setting("kv_connector", str, "pdserve", "the workers' KV data plane: pdserve (pdserve's connector and transfer "
            "engine), nixl (vLLM's NixlConnector; no KV pool) or mooncake (vLLM's MooncakeConnector over Mooncake "
            "Transfer Engine; no KV pool); the router speaks its P -> D hand-off",
            (L, W, R), choices=KV_CONNECTORS, group="gpus", argv="changed",
            advice="choose pdserve (pdserve's KV connector, the default), nixl (vLLM's NixlConnector) or mooncake "
            "(vLLM's MooncakeConnector)"),
    Setting("mooncake_protocol", str, "tcp", "--kv-connector mooncake: Mooncake Transfer Engine's protocol "
            "(MooncakeConnector's mooncake_protocol): tcp (any host), rdma or efa (clusters whose Mooncake build "
            "has them)", (L, W), choices=MOONCAKE_PROTOCOLS, group="gpus",
            advice="choose " + ", ".join(MOONCAKE_PROTOCOLS)),
    Setting("mooncake_bootstrap_port", int, MOONCAKE_BOOTSTRAP_PORT, "--kv-connector mooncake: the port of each "
            "prefill worker's Mooncake bootstrap server on the worker's host (vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT); "
            "the router asks it for P's engine id and hands its address to D", (R,), minimum=1, maximum=65535,
            group="gpus", argv="changed", metavar="PORT", advice="use a TCP port 1-65535"),
    Setting("mooncake_bootstrap", str, "", "--kv-connector mooncake: per-worker bootstrap ports where workers "
            "share a host, as URL=PORT,URL=PORT (the launcher sets it); a worker not listed uses "
            "--mooncake-bootstrap-port", (R,), metavar="URL=PORT,...", group="gpus", argv="set"),
    Setting("max_num_batched_tokens", int, None, "the workers' vLLM --max-num-batched-tokens (per-step token "
            "budget, prefill chunk size; default vLLM's); the conductor's chunk model for elastic placement",
            (L, W, R, C), unit="tokens", minimum=1, optional=True, group="workers", argv="set", metavar="N",
            targets=(Target("conductor", "chunk_tokens"),),
            advice="the workers' vLLM --max-num-batched-tokens (tokens per step, >= 1), or leave it unset when "
            "unknown"),
    Setting("stream_interval", int, 1, "the streaming workers' vLLM --stream-interval: tokens per streamed event "
            "(1: an event a token). Larger: fewer events, less worker and router CPU per token (the router relays "
            "an event, not a token), coarser streaming: a chunk's first token reaches the client when its last "
            "is made (the first token and the finish always go at once)", (L, W), unit="tokens", minimum=1,
            group="workers", metavar="N",
            advice="use a whole number of tokens >= 1 (1: vLLM's default, one event a token)"),
    Setting("local_prefill_tokens", int, None, "run requests with at most this many uncached prompt tokens on the "
            "decode worker alone (default: learned from the cost model)", (R, C), unit="tokens", minimum=0,
            optional=True, group="placement", targets=(Target("conductor", "local_prefill_tokens"),),
            advice="use an integer >= 0 (0 never runs a request decode-local), or leave it unset to let the "
            "conductor learn the threshold"),
    Setting("block_size", int, 128, "workers' KV block size in tokens (block keys must match it)", (R, C, IX),
            unit="tokens", minimum=1, group="placement", targets=(Target("conductor", "block_size"),),
            advice="the workers' KV block size in tokens (vLLM on CPU uses 128)"),
    Setting("calibrate", bool, True, "time a few prefills and decodes per worker at start-up to seed the cost "
            "model", (R,), off_flag="--no-calibrate", group="placement"),
    Setting("load_interval_s", float, 1.0, "period of worker /metrics reads", (R,), unit="s", minimum=0,
            above=True, group="placement", advice="must be > 0 seconds"),
    Setting("pool_master", str, "", "HOST:PORT of the KV pool master (secret in $PDSERVE_TRANSFER_SECRET): the "
            "router's conductor counts pooled prefixes as loadable; a worker's connector saves finished blocks to "
            "the pool and loads pooled prefixes (the launcher sets both when it starts the pool)", (R, W, IX),
            metavar="HOST:PORT", group="placement", argv="set"),
    Setting("mooncake_store", str, "", "--pool-backend mooncake: HOST:PORT of the Mooncake Store master's HTTP "
            "admin server (its metrics port): the router's conductor counts blocks pooled in the store as loadable "
            "(the launcher sets it with --policy conductor)", (R,), metavar="HOST:PORT", group="placement",
            argv="set"),
    Setting("indexer", str, "", "URL of a KV indexer service (pdserve indexer): at start the router seeds its "
            "prefix index from the indexer's snapshot and resumes each worker's KV events from there, so it knows "
            "prefixes older than the workers' replay buffers; with --policy conductor it shares its placements "
            "through the indexer as placeholders, and applies the other replicas' (the launcher sets it with "
            "--start-indexer)", (R,), metavar="URL", group="placement", argv="set"),
    Setting("tier_pricing", str, "priced", "conductor: how a prefill worker's start is priced. priced: its device "
            "prefix, or a longer one loaded from its own host or disk offload, the pool's memory or disk or a store, "
            "each at its tier's bandwidth; flat: as before tiers (the pool's memory and disk alike at the pool's "
            "transfer price, no offload or store tiers); device: its device prefix only (the pool is not counted)",
            (L, R, C), choices=TIER_PRICING, group="placement", argv="changed",
            targets=(Target("conductor", "tier_pricing"),), advice="priced, flat or device"),
    Setting("early_dispatch", bool, True, "send D its request as soon as P and D are chosen, before P answers "
            "(pdserve's connector: D waits in vLLM's WAITING_FOR_REMOTE_KVS for the blocks P announces under a "
            "hand-off id once its prompt is computed and continues after P's first token or regenerates it, "
            "--early-continue; vLLM's "
            "MooncakeConnector: D's pull of the transfer id at once; NixlConnector: never)", (L, R),
            off_flag="--no-early-dispatch", group="placement", argv="changed"),
    Setting("early_continue", str, "auto", "with early dispatch on pdserve's connector, requests whose first token "
            "P streams. always: P gives D that token once sampled and D continues after it (its first step samples "
            "the second token); never: D regenerates it from P's KV and the router checks it equals P's (greedy or "
            "D-sampled requests only, others go serial); auto: never where P says it announces layers as its "
            "forward writes them (layerwise_kv: D has the whole KV when P's forward ends) and sampling is greedy, "
            "always otherwise", (L, R), choices=EARLY_CONTINUE, group="placement", argv="changed",
            advice="auto, always or never"),
    Setting("moves", bool, True, "elastic: move running decodes off a worker that starts a long prefill when the "
            "conductor predicts it pays", (R, C), off_flag="--no-moves", group="placement",
            targets=(Target("moves", "enabled"),)),
    Setting("local_stall_s", float, 0.05, "the longest prefill a decode worker may run locally while it has "
            "running decodes", (C,), unit="s", minimum=0, advice="seconds >= 0"),
    Setting("min_fetch_blocks", int, 1, "fetch a pooled prefix only when it is at least this many blocks longer "
            "than P's own", (C,), minimum=1, advice="use >= 1"),
    Setting("load_staleness_s", float, 3.0, "worker-reported load older than this is ignored", (C,), unit="s",
            minimum=0, above=True, advice="seconds > 0"),
    Setting("kv_reserve", float, 0.02, "fraction of each worker's KV kept free when checking that a request fits",
            (C,), minimum=0, maximum=1, below=True, advice="a fraction in [0, 1)"),
    Setting("split_harm_handoffs", float, 1.0, "elastic placement splits a prefill off a decoding worker only when "
            "its harm to the decodes it stalls is over this many hand-offs", (C,), minimum=0, above=True,
            advice="a positive number of hand-offs (1, the default: split when the stall costs more than one "
            "hand-off)"),
    Setting("recalibration_window", int, 0, "the conductor corrects its predicted TTFT half way toward the median "
            "measured/predicted TTFT of the last this many placements, fleet-wide, when that error is one-sided (a "
            "sign test; factor within [1/4, 4]; TPOT is not corrected; 0, the default: off, it helped in 3 of 5 "
            "measured runs; docs/conductor.md)",
            (L, R, C), minimum=0, maximum=4096, group="placement", argv="changed",
            targets=(Target("conductor", "recalibration_window"),),
            advice="a number of placements in [0, 4096], e.g. 24 (0 turns the correction off)"),
    # ---------------------------------------------------------------- the router's server
    Setting("mode_hint", str, "", "start with no workers in this mode; workers join via POST /v1/pdserve/workers",
            (R,), choices=ROUTER_MODES, flag="--mode", group="server",
            advice="colocated, disaggregated or elastic"),
    Setting("prefiller_header", bool, False, "run as a gateway's decode sidecar, beside the one --decode worker: a "
            "request whose x-prefiller-host-port (set by the endpoint picker, pdserve picker or llm-d's) names a "
            "registered prefill worker runs prefill there and decode on the local D (the router's P -> D path); "
            "one without it, or naming a host:port that is not a registered prefill worker (never dialled), runs "
            "whole on the local D (docs/picker.md)", (R,), flag="--prefiller-header", group="server"),
    Setting("connect_timeout_s", float, 5.0, "seconds to connect to a worker", (R,), unit="s", minimum=0,
            above=True, group="server", advice="must be > 0 seconds"),
    Setting("upstream_idle_timeout_s", float, 120.0, "fail a request when its worker sends nothing for this long",
            (R,), unit="s", minimum=0, above=True, group="server", advice="must be > 0 seconds"),
    Setting("health_timeout_s", float, 2.0, "seconds a health probe may take", (R,), unit="s", minimum=0,
            above=True, group="server", advice="must be > 0 seconds"),
    Setting("health_interval_s", float, 5.0, "period of the background health probes (0: off)", (R,), unit="s",
            minimum=0, group="server", advice="use >= 0 (0 turns probes off)"),
    Setting("log_level", str, "info", "log level (debug, info, warning, error)", (R,), group="server"),
    Setting("max_body_bytes", int, DEFAULT_MAX_BODY_BYTES, "largest request body accepted (413 above it)", (R,),
            unit="bytes", minimum=MIN_BODY_BYTES, maximum=MAX_BODY_BYTES, metavar="N", group="server",
            advice=f"give a byte count from {MIN_BODY_BYTES} to {MAX_BODY_BYTES} (1 GiB), e.g. {8 << 20} for 8 MiB; "
            f"the default is {DEFAULT_MAX_BODY_BYTES} (4 MiB)"),
    Setting("tool_call_parser", str, "", "vLLM tool parser for tool_choice auto (e.g. hermes), as `vllm serve "
            "--tool-call-parser`", (R,), metavar="NAME", group="server"),
    # ---------------------------------------------------------------- failures and overload (the router)
    Setting("migration_limit", int, 2, "a worker that dies with a request in flight (connection closed, silent past "
            "--upstream-idle-timeout-s, a 5xx) is left out and the request goes on on another worker with the "
            "prompt plus every token already streamed, max_tokens reduced; the client sees one stream (greedy "
            "output equal to an undisturbed run's). Past this many moves: an error event (migration_limit)", (R,),
            minimum=0, maximum=100, group="failures",
            advice="how many times a request may move to another worker when its worker dies, 0 (never) to 100; "
            "default 2"),
    Setting("request_timeout_s", float, 600.0, "every request's deadline: 504 request_timeout before the first "
            "token, an error event after; the worker streams are closed, so vLLM frees their KV", (R,), unit="s",
            minimum=0, above=True, group="failures",
            advice="give a number of seconds > 0"),
    Setting("handoff_timeout_s", float, 60.0, "P's answer -> D's first token; past it 504 / error event "
            "handoff_timeout", (R,), unit="s", minimum=0, above=True, group="failures",
            advice="give a number of seconds > 0"),
    Setting("max_inflight", int, 2048, "requests in flight in the router; above it 429 + Retry-After "
            "(max_inflight) before the body is read (0: no limit)", (R,), minimum=1,
            optional=True, zero_is_none=True, group="failures",
            advice="give a count >= 1 (or 0 on the command line for no limit)"),
    Setting("max_inflight_per_worker", int, 512, "requests placed on one worker, every policy; full workers are "
            "skipped, 429 + Retry-After (worker_limit) when all are (0: no limit)", (R, C), minimum=1,
            optional=True, zero_is_none=True, group="failures",
            targets=(Target("conductor", "max_inflight_per_worker", default=None),),
            advice="give a count >= 1 (or 0 on the command line for no limit)"),
    Setting("probe_failures", int, 3, "a slow worker is not a dead one: it is taken out only when its health "
            "probes fail (time out or break) this many times in a row over at least --probe-window-s, or at once on "
            "evidence of death (connection refused, /health not 200); a timeout on a request only moves that "
            "request", (R,), minimum=1, group="failures", advice="give a count >= 1"),
    Setting("probe_window_s", float, 10.0, "the failed probes of --probe-failures must span at least this long",
            (R,), unit="s", minimum=0, above=True, group="failures",
            advice="give a number of seconds > 0"),
    # ---------------------------------------------------------------- the KV pool the launcher starts
    Setting("pool", bool, None, "start a KV pool (master + one store node) for the workers' connectors (default: "
            "on whenever pdserve's connector is)", (L, P), optional=True, flag="--pool", off_flag="--no-pool",
            group="pool"),
    Setting("pool_mem", object, "1GiB", "host memory the pool node lends, e.g. 1GiB", (L, P), metavar="SIZE",
            group="pool"),
    Setting("pool_disk", object, "0", "SSD tier size, e.g. 8GiB (0: no SSD tier)", (L, P), metavar="SIZE",
            group="pool"),
    Setting("pool_disk_dir", str, "", "SSD tier folder (default: pool-ssd in the run folder, removed at stop)",
            (L, P), metavar="DIR", group="pool"),
    Setting("pool_port", int, 0, "pool master port (0: a free one)", (L, P), minimum=0, maximum=65535,
            advice=_PORT, group="pool"),
    Setting("pool_backend", str, "pdserve", "the KV pool: pdserve (pdserve store master + node, through pdserve's "
            "connector) or mooncake (Mooncake Store: the launcher runs mooncake_master, each worker lends pool_mem "
            "and loads vLLM's MooncakeStoreConnector next to the P -> D connector through vLLM's MultiConnector; "
            "with --kv-connector nixl or mooncake; turns the pool on)", (L,), choices=POOL_BACKENDS,
            group="pool", advice="choose pdserve (pdserve's own pool) or mooncake (Mooncake Store)"),
    # ---------------------------------------------------------------- the KV indexer service (pdserve indexer)
    Setting("start_indexer", bool, False, "start a KV indexer (pdserve indexer) beside the routers: every router "
            "replica seeds its prefix index from it and shares its placements through it as placeholders, so "
            "replicas see each other's fresh placements and a restarted router knows prefixes older than the "
            "workers' replay buffers (policy conductor; docs/indexer.md)", (L,), group="indexer",
            advice="use true (start an indexer) or false"),
    Setting("indexer_host", str, "127.0.0.1", "the indexer's HTTP address (bind)", (IX,), minimum=1,
            group="indexer",
            advice="a host name or IP address"),
    Setting("indexer_port", int, 8100, "the indexer's HTTP port (0 = a free port)", (IX,), minimum=0,
            maximum=65535, advice=_PORT, group="indexer"),
    Setting("indexer_snapshot", str, "", "file the indexer snapshots its table and each stream's resume point to, "
            "and restores from at start (empty: no snapshots)", (IX,), metavar="PATH", group="indexer"),
    Setting("indexer_snapshot_interval_s", float, 10.0, "seconds between snapshots (0: only on shutdown and POST "
            "/snapshot)", (IX,), unit="s", minimum=0, metavar="S", group="indexer",
            advice="use a number of seconds >= 0"),
    Setting("xxh3", bool, False, "also map each stored block to Mooncake's XXH3 rolling sequence hash (its indexer "
            "API's hashing standard), so POST /query_by_hash takes \"hash\": \"xxh3\" seq_hashes; costs a second "
            "map of up to --xxh3-max-blocks entries", (IX,), group="indexer"),
    Setting("xxh3_seed", int, 0, "the XXH3 seed S of Mooncake's hashing standard (every publisher and client must "
            "use the same)", (IX,), minimum=0, maximum=(1 << 64) - 1, metavar="S", group="indexer",
            advice="use an integer in [0, 2**64)"),
    Setting("xxh3_max_blocks", int, 2_000_000, "the XXH3 map's bound (the oldest learned blocks go first; a "
            "forgotten block is not found by its XXH3 hash)", (IX,), minimum=1, metavar="N", group="indexer",
            advice="use a whole number of blocks >= 1"),
    Setting("placeholder_ttl_s", float, 10.0, "life of a placeholder entry (a placement not yet confirmed by its "
            "worker's KV event)", (IX,), unit="s", minimum=0, above=True, metavar="S", group="indexer",
            advice=_SECONDS),
    # ---------------------------------------------------------------- the endpoint picker (pdserve picker)
    Setting("picker_host", str, "0.0.0.0", "the picker's gRPC (Envoy ext-proc) address (bind)", (PK,), minimum=1,
            group="picker", advice="a host name or IP address"),
    Setting("picker_port", int, 9002, "the picker's gRPC port (0 = a free port; 9002 is the Gateway API Inference "
            "Extension's default)", (PK,), minimum=0, maximum=65535, advice=_PORT, group="picker"),
    Setting("destination_port", int, 0, "the port x-gateway-destination-endpoint names on the chosen decode "
            "worker's host: its routing sidecar's (pdserve router --prefiller-header beside it, the InferencePool's "
            "target port), which runs P's prefill and D's decode; 0: the decode worker's own port (D serves the "
            "request whole)", (PK,), minimum=0, maximum=65535, metavar="PORT", group="picker",
            advice="use a TCP port 1-65535 (the decode pods' sidecar port), or 0 for the decode worker's own"),
    Setting("prefill_dns", str, "", "follow the prefill pool's ready workers under this DNS NAME:PORT (a headless "
            "Service): added as they appear, removed when gone (pdserve.kube.discovery's rules; empty: --prefill "
            "only)", (PK, IX), metavar="NAME:PORT", group="picker"),
    Setting("decode_dns", str, "", "follow the decode pool's ready workers under this DNS NAME:PORT (as "
            "--prefill-dns)", (PK, IX), metavar="NAME:PORT", group="picker"),
    Setting("discovery_interval_s", float, 5.0, "seconds between two DNS reconciliations of --prefill-dns / "
            "--decode-dns", (PK, IX), unit="s", minimum=0, above=True, metavar="S", advice=_SECONDS, group="picker"),
    # ---------------------------------------------------------------- supervision (the launcher)
    Setting("restart", bool, True, "restart processes that exit, with backoff", (L,), off_flag="--no-restart",
            advice="use true (restart processes that exit) or false", group="supervision"),
    Setting("restart_backoff_s", float, 1.0, "seconds before the first restart; doubled per exit in a row", (L,),
            unit="s", minimum=0, above=True, flag="--restart-backoff", metavar="S", advice=_SECONDS,
            group="supervision"),
    Setting("restart_backoff_max_s", float, 30.0, "longest wait before a restart", (L,), unit="s", minimum=0,
            above=True, flag="--restart-backoff-max", metavar="S", advice=_SECONDS, group="supervision"),
    Setting("restart_reset_s", float, 300.0, "seconds healthy after which the backoff starts over", (L,), unit="s",
            minimum=0, above=True, flag="--restart-reset", metavar="S", advice=_SECONDS, group="supervision"),
    Setting("crash_loop_restarts", int, 5, "restarts within --crash-loop-window after which the next exit gives a "
            "process up", (L,), minimum=1, metavar="N", group="supervision",
            advice="use a whole number >= 1 (restarts within crash_loop_window_s before a process is given up; "
            "default 5)"),
    Setting("crash_loop_window_s", float, 600.0, "the crash-loop window in seconds", (L,), unit="s", minimum=0,
            above=True, flag="--crash-loop-window", metavar="S", advice=_SECONDS, group="supervision"),
    Setting("metrics_port", int, 0, "port of the launcher's own /metrics (process restarts), on --host (0: a free "
            "one)", (L,), minimum=0, maximum=65535, advice=_PORT, group="supervision"),
    Setting("otlp_traces_endpoint", str, "", "send OpenTelemetry traces over OTLP to this collector (gRPC, e.g. "
            "http://127.0.0.1:4317; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf: OTLP/HTTP): the router's "
            "span per request and every vLLM worker's own spans (vLLM's flag of that name), joined by the "
            "traceparent the router sends P and D (empty: tracing off, no span made)", (L, W, R), metavar="URL",
            group="observability", argv="set",
            advice="a collector's OTLP endpoint such as http://127.0.0.1:4317, or empty for no tracing"),
    Setting("otlp_traces_sample_ratio", float, 1.0, "share of the router's requests traced when tracing is on (a "
            "client's sampled traceparent is always followed)", (L, R), minimum=0, maximum=1,
            group="observability", argv="changed", metavar="R",
            advice="use a ratio from 0 to 1 (1: every request)"),
    # ---------------------------------------------------------------- pdserve's connector in each worker
    # (kv_connector_extra_config; the launcher's connector_extra adds to it): pdserve.settings.connector
    Setting("transfer_host", str, "127.0.0.1", "where this worker's transfer engine listens", (W,), minimum=1,
            on_cli=False, group="connector", advice="a host name or IP address"),
    Setting("advertise_host", str, "", "the address decode workers dial (needed when transfer_host is a wildcard)",
            (W,), on_cli=False, group="connector", advice="a host name or IP address"),
    Setting("transfer_port", int, 0, "the transfer engine's port (0: a free one, told through vLLM's handshake; "
            "a fixed port P binds P + tensor-parallel rank)", (W,), minimum=0, maximum=65535, on_cli=False,
            group="connector"),
    Setting("backend", str, "auto", "transfer-engine data path (auto: same-host copy when possible, else TCP)",
            (W,), choices=BACKENDS, on_cli=False, group="connector"),
    Setting("streams", int, 4, "parallel TCP connections per peer", (W,), minimum=1, maximum=64, on_cli=False,
            group="connector"),
    Setting("transfer_deadline_s", float, 30.0, "longest a READ batch may take before D gives up and recomputes",
            (W,), unit="s", minimum=0.1, maximum=3600, on_cli=False, group="connector"),
    Setting("handoff_wait_s", float, 60.0, "longest D waits for P's prefill in an early hand-off (the router sent D "
            "while P prefills) before it computes the prompt itself", (W,), unit="s", minimum=0.1, maximum=3600,
            on_cli=False, group="connector"),
    Setting("clock_margin_s", float, 0.5, "D stops trusting P's blocks this long before P's lease deadline (clock "
            "skew)", (W,), unit="s", minimum=0, maximum=60, on_cli=False, group="connector"),
    Setting("on_load_failure", str, "recompute", "recompute (D recomputes the prompt) or fail (the request errors)",
            (W,), choices=("recompute", "fail"), on_cli=False, group="connector"),
    Setting("allow_test_faults", bool, False, "honour pdserve_test_fault in kv_transfer_params (tests only)", (W,),
            on_cli=False, group="connector"),
    Setting("idle_wait_ms", float, 10.0, "pace the empty steps vLLM runs while P holds blocks and has nothing else "
            "to do, and D's while its early reads wait for P (a read's end wakes D at once) (0: let them spin)",
            (W,), unit="ms", minimum=0, maximum=1000, on_cli=False, group="connector"),
    Setting("pool_save", bool, True, "save finished blocks to the KV pool (with pool_master)", (W,), on_cli=False,
            group="connector"),
    Setting("pool_load", bool, True, "load pooled prefixes from the KV pool (with pool_master)", (W,), on_cli=False,
            group="connector"),
    Setting("pool_min_blocks", int, 1, "load from the pool only when at least this many blocks are pooled", (W,),
            minimum=1, maximum=1 << 20, on_cli=False, group="connector"),
    Setting("pool_timeout_s", float, 1.0, "longest a control call to the pool master may take", (W,), unit="s",
            minimum=0.05, maximum=60, on_cli=False, group="connector"),
    Setting("pool_backoff_s", float, 5.0, "after a failed pool call the pool is skipped this long", (W,), unit="s",
            minimum=0, maximum=3600, on_cli=False, group="connector"),
    Setting("sync_load_max_bytes", int, 32 << 20, "D reads P's KV inside its next forward when this rank's read is "
            "at most this many bytes, larger reads stay asynchronous (0: always asynchronous)", (W,), unit="bytes",
            minimum=0, maximum=1 << 40, on_cli=False, group="connector"),
    Setting("sync_load_deadline_s", float, 2.0, "longest a synchronous read may hold D's step (then it fails and "
            "vLLM recomputes)", (W,), unit="s", minimum=0.01, maximum=60, on_cli=False, group="connector"),
    Setting("layer_batch_bytes", int, 1 << 20, "a layer-by-layer read asks P for enough new layers that one batch "
            "carries at least this many bytes (a short prompt's small layers move in fewer batches, each with its "
            "fixed cost and P's answer; 0: a batch as soon as any layer is new)", (W,), unit="bytes", minimum=0,
            maximum=1 << 40, on_cli=False, group="connector"),
    Setting("kv_checksum", bool, True, "checksum every KV block that crosses a process (P's leased blocks, pool "
            "objects) and verify it before vLLM uses the block (pdserve's connector; kv_connector_extra_config "
            "kv_checksum)", (L, W), flag="--kv-checksum", off_flag="--no-kv-checksum", group="workers"),
    Setting("layerwise_kv", bool, True, "move an early hand-off's KV layer by layer: P announces each layer as its "
            "attention writes it, D reads (and verifies) each one while P computes the rest, instead of the whole "
            "prompt after P's last forward (pdserve's connector, same TP on P and D; kv_connector_extra_config "
            "layerwise_kv)", (L, W), flag="--layerwise-kv", off_flag="--no-layerwise-kv", group="workers"),
)

BY_NAME = {s.name: s for s in SETTINGS}


def setting(name: str) -> Setting:
    return BY_NAME[name]


def default(name: str, process: str = "") -> Any:
    """The declared default of ``name`` (in ``process`` when it has its own)."""
    s = BY_NAME[name]
    return s.default_for(process) if process else s.default


def of(process: str) -> tuple[Setting, ...]:
    """The settings ``process`` gets, in table order."""
    return tuple(s for s in SETTINGS if process in s.processes)
