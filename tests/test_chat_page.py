"""The chat page at `/` of `minillm serve`, driven in headless Chromium over the DevTools protocol: the
test types into the fields and clicks the buttons with real input events and reads the DOM. A short
greedy answer equals the server's unstreamed answer to the same conversation; a long one is seen
growing, then Stop aborts it mid-answer and the server frees the request (no KV block in use, one
more request ended by "abort"). The page needs the API key the server was started with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from serve_utils import serve, total
from test_site import CHROMIUM_FLAGS, _chromium

httpx = pytest.importorskip("httpx")
websocket = pytest.importorskip("websocket")
pytest.importorskip("fastapi")

KEY = "sk-page-test"
STATIC = Path(__file__).resolve().parent.parent / "minillm" / "entrypoints" / "openai" / "static"
# the site test's flags, less its virtual clock (this page must stream in real time)
FLAGS = [f for f in CHROMIUM_FLAGS if not f.startswith("--virtual-time-budget")]


class Page:
    """One Chromium tab over the DevTools protocol (a websocket), every wait bounded."""

    def __init__(self, url: str, profile: str):
        self.proc = subprocess.Popen([_chromium(), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                                      "--remote-allow-origins=*", url],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)  # its own group: close() stops the helpers too
        active = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (active.is_file() and active.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline and self.proc.poll() is None, "Chromium did not open its debug port"
            time.sleep(0.1)
        port = int(active.read_text().split()[0])
        while True:
            pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
            if pages:
                break
            assert time.monotonic() < deadline, "Chromium opened no page"
            time.sleep(0.1)
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self.next_id, self.exceptions = 0, []
        self.call("Runtime.enable")

    def close(self):
        self.ws.close()
        # Chromium's renderer, GPU and crashpad helpers can outlive the browser and keep writing into the
        # profile, so the whole process group goes, and then we wait for the browser itself
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("method") == "Runtime.exceptionThrown":
                self.exceptions.append(message["params"]["exceptionDetails"])
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float = 60.0):
        """Poll until the expression is truthy (an error, e.g. the page not loaded yet, counts as not)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if value := self.eval(expression):
                    return value
            except RuntimeError as e:
                error = e
            else:
                error = None
            assert time.monotonic() < deadline, f"timed out waiting for {expression} (last error: {error})"
            time.sleep(0.05)

    def click(self, selector: str):
        x, y = self.eval(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                         f" return [r.x + r.width / 2, r.y + r.height / 2]; }})()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type(self, selector: str, text: str, replace: bool = True):
        self.click(selector)
        if replace:  # Ctrl+A, so the typed text replaces the field's value
            self.call("Input.dispatchKeyEvent", type="keyDown", key="a", code="KeyA", modifiers=2, commands=["selectAll"])
            self.call("Input.dispatchKeyEvent", type="keyUp", key="a", code="KeyA", modifiers=2)
        self.call("Input.insertText", text=text)

    def press_enter(self):
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)


def answer_text(page: Page) -> str:
    return page.eval("[...document.querySelectorAll('.msg.assistant')].at(-1)?.textContent ?? ''")


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    with serve(tiny_chat_model, "--api-key", KEY, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.mark.slow
def test_page_is_served_without_cdn(server):
    r = httpx.get(f"{server.base}/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for name in ("chat.js", "chat.css"):
        assert httpx.get(f"{server.base}/static/{name}", timeout=10).status_code == 200
    for file in STATIC.iterdir():  # nothing fetched from elsewhere
        assert "://" not in file.read_text(), file


def test_chat_page_streams_and_stops(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:  # a late helper's file
        page = Page(f"{server.base}/", profile)
        try:
            page.wait("document.getElementById('model').textContent.includes('API key')")  # 401 shown
            page.type("#api-key", KEY)
            page.click("#prompt")  # leaving the field: the page asks for the model again, with the key
            model = page.wait("(t => t.includes('/') && t)(document.getElementById('model').textContent)")
            assert model == str(server.proc.args[server.proc.args.index("--model") + 1])

            # a short greedy answer, sent with the button: the same as the server's unstreamed answer
            page.type("#temperature", "0")
            page.type("#max-tokens", "12")
            page.type("#prompt", "what does the cat say?")
            page.click("#send")
            page.wait("document.getElementById('stats').dataset.finish")
            stats = page.eval("({...document.getElementById('stats').dataset})")
            oracle = httpx.post(f"{server.v1}/chat/completions", headers=auth, timeout=60, json={
                "messages": [{"role": "user", "content": "what does the cat say?"}], "temperature": 0,
                "max_tokens": 12}).json()
            assert answer_text(page) == oracle["choices"][0]["message"]["content"] != ""
            assert stats["finish"] == oracle["choices"][0]["finish_reason"]
            assert int(stats["tokens"]) == oracle["usage"]["completion_tokens"]
            assert float(stats["ttftMs"]) > 0 and float(stats["tokensPerS"]) > 0
            assert "tokens/s" in page.eval("document.getElementById('stats').textContent")

            # a long answer, sent with Enter: seen growing, then stopped mid-answer
            before = server.wait_idle()
            page.type("#max-tokens", "3500")
            page.click("#ignore-eos")
            page.type("#prompt", "go on")
            page.press_enter()
            first = page.wait("(t => t.length > 0 && t.length)([...document.querySelectorAll('.msg.assistant')].at(-1).textContent)")
            page.wait(f"[...document.querySelectorAll('.msg.assistant')].at(-1).textContent.length > {first}")
            busy = server.metrics()
            assert busy["minillm_num_requests_running"] == 1 and busy["minillm_kv_cache_used_blocks"] > 0
            page.click("#stop")
            page.wait("document.getElementById('stats').dataset.finish === 'stopped'")
            after = server.wait_idle()  # the server noticed the closed connection and freed the blocks
            assert after["minillm_kv_cache_used_blocks"] == 0
            ended = lambda m, reason: m.get(f'minillm_requests_total{{finish_reason="{reason}"}}', 0)
            assert ended(after, "abort") - ended(before, "abort") == 1
            assert total(after, "minillm_requests_total") - total(before, "minillm_requests_total") == 1
            assert 1 < int(page.eval("document.getElementById('stats').dataset.tokens")) < 3500
            assert page.eval("document.getElementById('send').disabled") is False
            assert page.eval("document.querySelectorAll('.msg.user').length") == 2
            assert page.exceptions == []
        finally:
            page.close()
