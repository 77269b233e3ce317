"""A real headless Chromium (Debian's ``chromium`` package) driven over the DevTools protocol, for the live view's
test: open a page, evaluate JavaScript in it, take a screenshot. ``CHROMIUM``: the browser found on PATH (None:
tests using it skip with the reason)."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
SKIP_REASON = "no Chromium on PATH (Debian: apt-get install chromium)"


class Browser:
    """One headless Chromium with one page, over CDP (``async with Browser() as b: await b.open(url)``)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.profile = tempfile.TemporaryDirectory(prefix="pdserve-chromium-")
        self.session: aiohttp.ClientSession | None = None
        self.ws: Any = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Browser:
        assert CHROMIUM is not None, SKIP_REASON
        self.proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                                      "--remote-debugging-port=0", f"--user-data-dir={self.profile.name}",
                                      "--window-size=1400,900", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not start its DevTools server")
            await asyncio.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        self.ws = await self.session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.profile.cleanup()

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command's result (events in between are skipped)."""
        i = next(self._ids)
        await self.ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def open(self, url: str) -> None:
        await self.send("Page.enable")
        await self.send("Page.navigate", url=url)

    async def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serializable)."""
        out = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return out["result"].get("value")

    async def until(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll the expression until it is truthy; its value (AssertionError past ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"the page never satisfied: {expression}")
            await asyncio.sleep(0.25)

    async def screenshot(self, path: Path) -> Path:
        out = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(out["data"]))
        return path
