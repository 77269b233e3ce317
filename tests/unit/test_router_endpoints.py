"""The router's front door (docs/architecture.md section 8): a new endpoint is one module in
pdserve/router/endpoints/, and a per-request check in ``Intake.check`` reaches every generation endpoint."""

from __future__ import annotations

import sys
from typing import Any

from pdserve.router import endpoints
from pdserve.router.endpoints.intake import Intake
from pdserve.router.errors import bad_request
from tests.unit.test_router_app import Env, FakeWorker, model_dir, run, tokenizer  # noqa: F401

BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "a b", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
    "/v1/messages": {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}]},
    "/v1/responses": {"input": "a", "max_output_tokens": 2},
}


def test_a_new_endpoint_is_one_module(model_dir, tokenizer, monkeypatch, tmp_path):
    """A module with add_routes(app, ctx) among endpoints/' modules is served; nothing else is edited. (The module
    is written to a folder added to the package's path, so no other test process sees it.)"""
    (tmp_path / "probe_endpoint.py").write_text(
        "from aiohttp import web\n\n\ndef add_routes(app, ctx):\n"
        "    async def hello(request):\n"
        "        return web.json_response({'model': ctx.config.served_model_name})\n\n"
        "    app.router.add_post('/v1/probe', hello)\n")
    monkeypatch.setattr(endpoints, "__path__", [*endpoints.__path__, str(tmp_path)])

    async def main() -> tuple[int, Any]:
        async with Env(model_dir, tokenizer, colocated=[FakeWorker("C")]) as env:
            return await env.post("/v1/probe", {})

    assert run(main()) == (200, {"model": "tiny"})
    sys.modules.pop("pdserve.router.endpoints.probe_endpoint", None)


def test_a_per_request_check_reaches_every_generation_endpoint(model_dir, tokenizer, monkeypatch):
    """One check added in Intake.check answers every generation endpoint's request (in each one's error shape),
    and a request it lets through is answered as before."""
    real = Intake.check

    def check(self: Intake, req: Any, request: Any) -> None:
        if request.headers.get("X-Probe") == "refuse":
            raise bad_request("refused by the probe check", "model")
        real(self, req, request)

    monkeypatch.setattr(Intake, "check", check)

    async def main() -> dict[str, tuple[int, int, str]]:
        out = {}
        async with Env(model_dir, tokenizer, colocated=[FakeWorker("C")]) as env:
            for path, body in BODIES.items():
                ok, _ = await env.post(path, body)
                st, err = await env.post(path, body, headers={"X-Probe": "refuse"})
                out[path] = (ok, st, str(err))
        return out

    for path, (ok, st, err) in run(main()).items():
        assert ok == 200 and st == 400 and "refused by the probe check" in err, (path, ok, st, err)
