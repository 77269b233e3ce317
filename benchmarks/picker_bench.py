"""The endpoint picker's decisions through its gRPC ext-proc service (issue 39): decisions per second per replica,
decision time p50/p99 (inside the picker) and the gateway's round trip p50/p99, at a fleet of N workers whose
prefix index holds M blocks; and the prefix hits of its decisions against the router's conductor placing the same
prompts on the same index (the same placement code, so they should match exactly).

    python benchmarks/picker_bench.py --workers 1000 --blocks 1000000 --requests 2000

Workers are URLs nobody answers (the load probe finds none: every report is missing, as for workers with no
traffic); prompts are token-id prompts of conversations in the index plus new tokens. Prints a table and a final
JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
from conductor_bench import BS, indexed  # noqa: E402
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402

from pdserve.conductor import Conductor, ConductorConfig, OnlineCostModel  # noqa: E402
from pdserve.picker.picker import Picker  # noqa: E402
from pdserve.picker.server import serve  # noqa: E402
from pdserve.router.config import RouterConfig  # noqa: E402
from pdserve.router.fleet.placement import ConductorPlacement  # noqa: E402
from pdserve.router.fleet.registry import WorkerRegistry  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def model_dir() -> Path:
    """The unit tests' tiny word-level tokenizer and a config.json the router's config reads (prompts here are
    token ids: the tokenizer is never asked)."""
    from tests.unit.test_router_app import write_tiny_model

    d = write_tiny_model(Path(tempfile.mkdtemp(prefix="pdserve-picker-bench-")))
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                                               "num_key_value_heads": 2, "hidden_size": 64,
                                               "num_attention_heads": 2, "max_position_embeddings": 1 << 20}))
    return d


def messages(prompt: list[int]) -> list[pb.ProcessingRequest]:
    hs = [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json")]
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 64}).encode()
    return [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]))),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


async def run(a: argparse.Namespace) -> dict:
    n_p = a.workers // 2
    prefill = tuple(f"http://10.{i // 250}.{i % 250}.1:8000" for i in range(n_p))
    decode = tuple(f"http://10.{i // 250}.{i % 250}.2:8000" for i in range(a.workers - n_p))
    cfg = RouterConfig(model_dir=str(model_dir()), prefill=prefill, decode=decode, policy="conductor",
                       block_size=BS, local_prefill_tokens=0, calibrate=False, load_interval_s=3600.0,
                       health_timeout_s=0.01)
    picker = Picker(cfg)
    index, convs = indexed(a.workers, a.blocks, 0)
    # the conductor's worker ids are the URLs: map the bench fleet's "p<i>"/"d<i>" holders onto them
    names = {f"p{i}": u for i, u in enumerate(prefill)} | {f"d{i}": u for i, u in enumerate(decode)}
    for h in list(index.holders()):
        keys = list(index.keys_of(h))
        picker.conductor.index.stored(names[h], keys)
    # the router's conductor on the same index, for the hit comparison
    ref = ConductorPlacement(Conductor(ConductorConfig(policy="conductor", block_size=BS, local_prefill_tokens=0),
                                       OnlineCostModel(picker.conductor.cost.kv_bytes_per_token)),
                             WorkerRegistry(cfg.all_workers()))
    ref.conductor.index = picker.conductor.index
    await picker.start()
    server = await serve(picker, "127.0.0.1", 0)
    rng = random.Random(a.seed)
    prompts = [rng.choice(convs)[:rng.randint(16, 64) * BS] + [rng.randrange(32000) for _ in range(rng.randint(1, 500))]
               for _ in range(a.requests)]
    rtt: list[float] = []
    hits_ref = same = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        t0 = time.perf_counter()
        for prompt in prompts:
            s = time.perf_counter()
            out = [r async for r in stub.Process(iter(messages(prompt)))]
            rtt.append(time.perf_counter() - s)
            got = {h.header.key: h.header.raw_value.decode()
                   for h in out[-1].request_body.response.header_mutation.set_headers}
            t = ref.choose(prompt, max_tokens=64)
            same += got.get("x-prefiller-host-port", "") == t.prefill.url.removeprefix("http://")  # type: ignore[union-attr]
            hits_ref += t.decision.cached_tokens
            t.close()
        wall = time.perf_counter() - t0
    hits_picker = picker.cached_tokens
    dec = list(picker.decision_seconds)
    await server.stop(0)
    await picker.close()
    return {"workers": a.workers, "indexed_blocks": len(index), "requests": len(prompts),
            "exchanges_per_s": round(len(prompts) / wall, 1),
            "decisions_per_s_inside": round(len(dec) / sum(dec), 1),
            "decision_p50_us": round(pct(dec, 50) * 1e6, 1), "decision_p99_us": round(pct(dec, 99) * 1e6, 1),
            "round_trip_p50_us": round(pct(rtt, 50) * 1e6, 1), "round_trip_p99_us": round(pct(rtt, 99) * 1e6, 1),
            "same_prefill_as_router_conductor": round(same / len(prompts), 4),
            "router_conductor_cached_tokens": hits_ref, "picker_cached_tokens": hits_picker,
            "load": os.getloadavg()[0], "median_rtt_ms": round(statistics.median(rtt) * 1e3, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=39)
    r = asyncio.run(run(p.parse_args()))
    print("| workers | blocks | exchanges/s | decisions/s (inside) | decision p50 / p99 us | round trip p50 / p99 us "
          "| same P as the router's conductor |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {r['workers']} | {r['indexed_blocks']:,} | {r['exchanges_per_s']} | {r['decisions_per_s_inside']} | "
          f"{r['decision_p50_us']} / {r['decision_p99_us']} | {r['round_trip_p50_us']} / {r['round_trip_p99_us']} | "
          f"{r['same_prefill_as_router_conductor']} |")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
