"""P -> D hand-off through PdserveConnector equals colocated serving, token for token.

Two vLLM CPU servers (one core each) load the connector; a random-weight fp32 Llama with decisive
logits makes any wrong KV visible. For each prompt: greedy output of P (max_tokens=1,
do_remote_decode) then D (prompt + [t1], P's kv_transfer_params) must equal one server's own
output. Negative control: the same hand-off with the received blocks zeroed must differ (so the KV
really came over the transfer engine). Also: P frees the blocks once D has read them, and after
the lease when no D comes; a failed read makes D recompute and still answer exactly.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve.launch.procs import free_port, spawn, stop_children

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600)]  # pd_pair: P and D of the shared pd_faults launch (tests/conftest.py: SHARED_STACKS)

try:  # vLLM present and importable (its import is slow, but the servers need it anyway)
    import vllm  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"vllm not importable: {exc}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SECRET = "pd-exactness-test-secret"
GEN = 17  # tokens compared: t1 from P + 16 from D
BLOCK = 128
LENGTHS = (100, 1000, 1900)
START_TIMEOUT_S = float(os.environ.get("PDSERVE_TEST_VLLM_START_S", "300"))


class Worker:
    """Requests to one vLLM server of these tests (started by :class:`Server` or by the launcher), and its log."""

    def __init__(self, url: str, log_path: Path) -> None:
        self.url = url
        self.log_path = log_path

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def reset_prefix_cache(self, timeout_s: float = 30.0) -> None:
        """Empty the worker's own prefix cache (vLLM's dev endpoint: start with env VLLM_SERVER_DEV_MODE=1), as a
        restarted worker's would be; retried while blocks are still held."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                if json.loads(r.read()).get("success"):
                    return
            time.sleep(0.2)
        raise AssertionError("vLLM did not reset its prefix cache")

    # ---- requests ----
    def complete(self, prompt: list[int], max_tokens: int, **extra) -> dict:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": False, "return_token_ids": True, "ignore_eos": True, **extra}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def stream(self, prompt: list[int], max_tokens: int, **extra) -> tuple[list[int], float]:
        """Streamed completion: (token ids, seconds to the first token)."""
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "return_token_ids": True, "ignore_eos": True, **extra}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        tokens: list[int] = []
        first = None
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter() - t0
                    tokens.extend(ids)
        return tokens, first or 0.0

    def metric(self, name: str) -> float:
        """Sum of a Prometheus sample over its label sets (0 when absent)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))

    def kv_usage(self) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
        assert m, "vllm:kv_cache_usage_perc missing from /metrics"
        return float(m.group(1))


class Server(Worker):
    """A vLLM server with PdserveConnector, started by the test (one core, fp32, served as "m")."""

    def __init__(self, model: Path, core: int, log_path: Path, extra: dict, dtype: str = "float32",
                 env_extra: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}", log_path)
        kv = {"kv_connector": "PdserveConnector", "kv_connector_module_path": "pdserve.vllm.connector",
              "kv_role": "kv_both", "kv_connector_extra_config": extra}
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(core),
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env_extra or {}))
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port),
               "--enforce-eager", "--max-model-len", "2048", "--dtype", dtype, "--kv-transfer-config", json.dumps(kv),
               *args]
        self.child = spawn("vllm", cmd, env=env, log_path=log_path, cwd=ROOT)
        self.proc = self.child.proc

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}); log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM server not ready in {START_TIMEOUT_S} s; log tail:\n{self.log_tail()}")

    def stop(self) -> None:
        stop_children([self.child], timeout_s=20)


def model_path(tmp_path_factory) -> Path:
    """The 2-layer random Llama these tests serve (built once per process, or taken from PDSERVE_TEST_MODEL_CACHE)."""
    from pdserve.launch.models import build_random_llama

    cache = os.environ.get("PDSERVE_TEST_MODEL_CACHE")
    out = Path(cache) / "random-llama-2l" if cache else tmp_path_factory.mktemp("model") / "random-llama"
    return build_random_llama(out)


@pytest.fixture(scope="module")
def servers(pd_pair):
    return pd_pair  # conftest.py: prefill0 and decode0 of the shared 1P2D launch


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def _tokens(resp: dict) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def _salt() -> str:
    return f"s{time.monotonic_ns()}"


def _wait_usage_zero(server: Worker, timeout: float) -> float:
    end = time.monotonic() + timeout
    usage = server.kv_usage()
    while usage > 1e-9 and time.monotonic() < end:
        time.sleep(0.25)
        usage = server.kv_usage()
    return usage


def _handoff(p: Worker, d: Worker, prompt: list[int], p_params: dict | None = None, fault: str = "",
             d_salt: bool = True):
    """P prefill (1 token), then D decodes the rest from P's KV; return (tokens, P params, D stats)."""
    # a fresh cache salt on both, as the router sends a client's salt to P and D (the hand-off's fingerprint
    # carries the key domain, so a salt on one side only is refused): D must not find the prompt in its own cache
    salt = {"cache_salt": _salt()} if d_salt else {}
    t0 = time.perf_counter()
    pr = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, **(p_params or {})}, **salt)
    t_p = time.perf_counter() - t0
    t1 = _tokens(pr)
    params = pr["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt), params
    dparams = dict(params, pdserve_test_fault=fault) if fault else params
    t0 = time.perf_counter()
    dr = d.complete(prompt + t1, GEN - 1, kv_transfer_params=dparams, **salt)
    t_d = time.perf_counter() - t0
    stats = (dr.get("kv_transfer_params") or {}).get("pdserve")
    return t1 + _tokens(dr), params, stats, (t_p, t_d)


@pytest.mark.parametrize("n", LENGTHS)
def test_pd_equals_colocated(servers, n):
    p, d = servers
    prompt = _prompt(n, seed=n)
    colocated = _tokens(d.complete(prompt, GEN, cache_salt=_salt()))
    assert len(colocated) == GEN
    tokens, params, stats, (t_p, t_d) = _handoff(p, d, prompt)
    nblocks = -(-n // BLOCK)
    assert len(params["remote_block_ids"]) == nblocks
    assert stats and stats["ok"] and stats["blocks"] == nblocks, stats
    # 2 layers x 2 kv heads x 128 tokens x (K+V) 2x64 x fp32 = 262144 B per block
    assert stats["bytes"] == nblocks * 2 * 2 * BLOCK * 2 * 64 * 4, stats
    print(f"\n[pd n={n}] P {t_p*1e3:.0f} ms, D {t_d*1e3:.0f} ms, read {stats['bytes']} B in "
          f"{stats['ms']:.2f} ms ({stats['bytes'] / 1e6 / max(stats['ms'], 1e-6):.2f} GB/s)")
    assert tokens == colocated, f"PD output differs from colocated for n={n}"
    # P freed the blocks once D's read notified it
    assert _wait_usage_zero(p, 10.0) <= 1e-9, "P still holds KV blocks after D read them"


def test_decode_reads_only_blocks_it_lacks(servers):
    p, d = servers
    prompt = _prompt(1000, seed=17)
    d.complete(prompt[:640], 1)  # D's prefix cache now holds the first 5 blocks
    colocated = _tokens(d.complete(prompt, GEN, cache_salt=_salt()))
    tokens, _, stats, _ = _handoff(p, d, prompt, d_salt=False)
    assert stats and stats["ok"] and stats["blocks"] == 8 - 5, stats
    assert stats["bytes"] == 3 * 2 * 2 * BLOCK * 2 * 64 * 4
    assert tokens == colocated
    assert _wait_usage_zero(p, 10.0) <= 1e-9


def test_full_local_hit_releases_p_without_reading(servers):
    p, d = servers
    prompt = _prompt(1024, seed=19)
    d.complete(prompt, 1)  # D caches all 8 blocks of the prompt
    colocated = _tokens(d.complete(prompt, GEN, cache_salt=_salt()))
    t0 = time.monotonic()
    tokens, params, stats, _ = _handoff(p, d, prompt, d_salt=False)
    assert stats is None, stats  # nothing read
    assert tokens == colocated
    assert _wait_usage_zero(p, 10.0) <= 1e-9 and time.monotonic() - t0 < 20  # well before the 30 s lease
    assert f"released P's blocks of {params['remote_request_id']}" in d.log_text()


def test_streamed_decode_equals_colocated(servers):
    """The router streams D's answer: same tokens as colocated, first token soon after the hand-off."""
    p, d = servers
    prompt = _prompt(1900, seed=23)
    colocated = _tokens(d.complete(prompt, GEN, cache_salt=_salt()))
    salt = _salt()  # P and D in one key domain: D refuses P's KV of another
    pr = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True}, cache_salt=salt)
    t1 = _tokens(pr)
    rest, first_s = d.stream(prompt + t1, GEN - 1, kv_transfer_params=pr["kv_transfer_params"],
                             cache_salt=salt)
    print(f"\n[stream n=1900] D first token {first_s * 1e3:.0f} ms after the hand-off")
    assert t1 + rest == colocated
    assert _wait_usage_zero(p, 10.0) <= 1e-9


def test_negative_control_zeroed_kv_changes_output(servers):
    p, d = servers
    prompt = _prompt(1000, seed=7)
    colocated = _tokens(d.complete(prompt, GEN, cache_salt=_salt()))
    tokens, _, stats, _ = _handoff(p, d, prompt, fault="zero")
    assert stats and stats["ok"] and stats["bytes"] > 0, stats
    assert tokens[0] == colocated[0]  # t1 comes from P, untouched
    assert tokens[1:] != colocated[1:], "zeroing the transferred KV did not change D's output"
    assert "pdserve_test_fault=zero" in d.log_text()


def test_failed_read_recomputes_exactly(servers):
    p, d = servers
    prompt = _prompt(1000, seed=11)
    colocated = _tokens(d.complete(prompt, GEN, cache_salt=_salt()))
    tokens, _, stats, _ = _handoff(p, d, prompt, fault="fail")
    assert stats and not stats["ok"], stats
    assert tokens == colocated, "after a failed read D must recompute and answer exactly"
    assert _wait_usage_zero(p, 10.0) <= 1e-9, "P kept blocks after D reported the failed read"


@pytest.mark.parametrize("breakage", ["block_ids_out_of_range", "p_unreachable"])
def test_unusable_remote_kv_recomputes_exactly(servers, breakage):
    """Wrong params from a router, or P gone: D recomputes and still answers exactly."""
    p, d = servers
    prompt = _prompt(300, seed=29 + len(breakage))
    colocated = _tokens(d.complete(prompt, GEN, cache_salt=_salt()))
    # P unreachable means P never hears from D: a short lease frees its blocks for the next tests
    lease = {"lease_s": 3} if breakage == "p_unreachable" else {}
    salt = _salt()  # P and D in one key domain: D refuses P's KV of another
    pr = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, **lease}, cache_salt=salt)
    params = dict(pr["kv_transfer_params"])
    if breakage == "block_ids_out_of_range":
        params["remote_block_ids"] = [10**7 + i for i in range(len(params["remote_block_ids"]))]
    else:
        params["remote_port"] = free_port()
    dr = d.complete(prompt + _tokens(pr), GEN - 1, kv_transfer_params=params, cache_salt=salt)
    stats = dr["kv_transfer_params"]["pdserve"]
    assert not stats["ok"] and stats["error"], stats
    assert _tokens(pr) + _tokens(dr) == colocated
    if breakage == "block_ids_out_of_range":  # D told P to free its blocks even though the read failed
        assert _wait_usage_zero(p, 10.0) <= 1e-9


def test_lease_frees_blocks_when_decode_never_comes(servers):
    p, _ = servers
    assert _wait_usage_zero(p, 10.0) <= 1e-9
    pr = p.complete(_prompt(1000, seed=13), 1, kv_transfer_params={"do_remote_decode": True, "lease_s": 2})
    assert pr["kv_transfer_params"]["remote_block_ids"]
    assert p.kv_usage() > 0, "P should hold the prompt's blocks during the lease"
    t0 = time.monotonic()
    assert _wait_usage_zero(p, 15.0) <= 1e-9, "P did not free the blocks when the lease ran out"
    assert time.monotonic() - t0 >= 1.0
    assert "within the lease" in p.log_text()


def test_connector_metrics_exported(servers):
    """The connector's counters reach vLLM's /metrics on both sides. The servers are shared with other
    tests, so this one makes its own hand-offs and checks how far each counter moved."""
    p, d = servers
    names = {d: ("reads_total", "read_bytes_total", "read_failures_total", "read_seconds_count"),
             p: ("released_notified_total", "released_lease_total")}
    before = {(s, n): s.metric(f"vllm:pdserve_kv_{n}") for s, ns in names.items() for n in ns}
    for seed in (41, 43):  # two clean reads of 3 blocks each
        _, _, stats, _ = _handoff(p, d, _prompt(300, seed=seed))
        assert stats and stats["ok"] and stats["blocks"] == 3, stats
    salt = _salt()  # P and D in one key domain: D refuses P's KV of another
    pr = p.complete(_prompt(200, seed=47), 1, kv_transfer_params={"do_remote_decode": True, "lease_s": 2},
                    cache_salt=salt)
    failed = dict(pr["kv_transfer_params"], remote_port=free_port())  # nobody there: the read fails
    d.complete(_prompt(200, seed=47) + _tokens(pr), 2, kv_transfer_params=failed, cache_salt=salt)
    want = {(d, "reads_total"): 2, (d, "read_bytes_total"): 2 * 3 * 2 * 2 * BLOCK * 2 * 64 * 4,
            (d, "read_failures_total"): 1, (d, "read_seconds_count"): 2,
            (p, "released_notified_total"): 2, (p, "released_lease_total"): 1}
    end = time.monotonic() + 15  # the failed read's blocks go back when their 2 s lease runs out
    moved = {}
    while time.monotonic() < end:
        moved = {k: k[0].metric(f"vllm:pdserve_kv_{k[1]}") - before[k] for k in want}
        if all(moved[k] >= v for k, v in want.items()):
            break
        time.sleep(0.5)
    assert all(moved[k] >= v for k, v in want.items()), {k[1]: (moved[k], v) for k, v in want.items()}


@pytest.mark.parametrize("load, fault", [("auto", ""), ("async", ""), ("async", "fail")])
def test_sync_and_async_loads_are_exact(servers, load, fault):
    """Issue 16: a small read loads inside D's next step (sync, the default here), a forced ``async`` one waits
    for its read as before; both, and a failed async read (recomputed), answer exactly."""
    p, d = servers
    prompt = _prompt(600, seed=31 + len(load) + len(fault))
    colocated = _tokens(d.complete(prompt, GEN, cache_salt=_salt()))
    salt = _salt()  # P and D in one key domain: D refuses P's KV of another
    pr = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True}, cache_salt=salt)
    params = dict(pr["kv_transfer_params"], pdserve_load=load, **({"pdserve_test_fault": fault} if fault else {}))
    dr = d.complete(prompt + _tokens(pr), GEN - 1, kv_transfer_params=params, cache_salt=salt)
    stats = dr["kv_transfer_params"]["pdserve"]
    assert stats["mode"] == ("sync" if load == "auto" else "async") and stats["ok"] == (not fault), stats
    assert _tokens(pr) + _tokens(dr) == colocated
    assert _wait_usage_zero(p, 10.0) <= 1e-9
    assert f'"p_req":"{params["remote_request_id"]}"' in d.log_text()  # the hand-off's timing line
