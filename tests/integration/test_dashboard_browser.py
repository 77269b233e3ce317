"""The live view (GET /dashboard) in a real headless Chromium (Debian's package, driven over DevTools:
tests/integration/headless.py) on a real 1P1D stack under the launcher's supervision: the page loads and shows the
fleet (both workers serving, their roles); a decode worker is SIGKILLed and the same page, polling, shows it out;
the launcher restarts it and the page shows it serving again with one restart seen. A screenshot is taken during
the kill (``PDSERVE_DASHBOARD_SCREENSHOT=PATH`` keeps it). Slow (a stack start and a worker restart): it runs with
PDSERVE_TEST_SLOW=1 (tests/conftest.py), and skips where Chromium is absent."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest

from .headless import CHROMIUM, SKIP_REASON, Browser

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON),
    pytest.mark.timeout(600),
]

ROWS = "[...document.querySelectorAll('#workers tr')].map(r => [r.dataset.worker, r.dataset.healthy, r.innerText])"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from pdserve.launch import Cluster
    from pdserve.launch.config import LauncherConfig
    from pdserve.launch.models import build_random_llama

    model = build_random_llama(tmp_path_factory.mktemp("dash-model") / "random-llama")
    cfg = LauncherConfig(model=str(model), prefill=1, decode=1, port=0, dtype="float32", max_model_len=1024,
                         served_model_name="m", run_dir=str(tmp_path_factory.mktemp("dash-run")),
                         worker_timeout_s=400, pool=False, policy="conductor", restart_backoff_s=0.5,
                         router_args=("--health-interval-s", "0.5", "--health-timeout-s", "1", "--no-calibrate"))
    with Cluster(cfg) as c:
        c.supervise_in_background()
        yield c


def _complete(url: str) -> None:
    body = {"model": "m", "prompt": list(range(100, 140)), "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=120).read()


def test_the_live_view_shows_the_fleet_and_a_killed_worker(stack, tmp_path):
    decode = next(c for c in stack.workers if c.name.startswith("decode"))
    shot = Path(os.environ.get("PDSERVE_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard-kill.png")
    for _ in range(3):
        _complete(stack.router_url)

    async def main() -> None:
        async with Browser() as b:
            await b.open(stack.router_url + "/dashboard")
            rows = await b.until(f"document.body.dataset.polls > 0 && {ROWS}")
            assert sorted(r[0] for r in rows) == sorted(stack.worker_urls()), rows
            assert all(r[1] == "true" for r in rows) and all("serving" in r[2] for r in rows), rows
            assert any("prefill" in r[2] for r in rows) and any("decode" in r[2] for r in rows), rows
            placed = await b.eval("['placed disaggregated', 'placed local'].map(k => Number(document.querySelector("
                                  "`[data-counter='${k}'] b`).innerText)).reduce((a, b) => a + b)")
            assert placed >= 3
            assert await b.eval("document.querySelectorAll('#recent tr').length") >= 3

            os.killpg(decode.pgid, signal.SIGKILL)
            down = f"document.querySelector('tr[data-worker=\"{decode.url}\"]')?.dataset.healthy === 'false'"
            await b.until(down, 30)
            await b.screenshot(shot)
            print("screenshot during the kill:", shot)
            back = (f"(r => r && r.dataset.healthy === 'true' && r.lastElementChild.innerText.trim() === '1')"
                    f"(document.querySelector('tr[data-worker=\"{decode.url}\"]'))")
            await b.until(back, 300)  # the launcher restarts it; the router's probe takes it back

    asyncio.run(main())
