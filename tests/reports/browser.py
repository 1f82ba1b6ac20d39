"""Open a page in headless Chromium and report what a user's browser would do with it.

Drives Chromium through the DevTools protocol over ``--remote-debugging-pipe`` (JSON messages
ending in NUL, on file descriptors 3 and 4 of the browser): no websocket library, no port. It
records every network request the page makes, console messages, uncaught exceptions and
dialogs (an ``alert()`` that ran), and gives back the page's text, its DOM counts and a
full-page screenshot.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM"), *CHROMIUM_NAMES):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@dataclass
class PageVisit:
    url: str
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    console: list[tuple[str, str]] = field(default_factory=list)  # (level, text)
    exceptions: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    text: str = ""  # document.body.innerText
    counts: dict = field(default_factory=dict)  # DOM queries -> number of matches
    broken_images: int = 0  # <img> that did not load or decode
    screenshot: bytes = b""  # PNG of the whole page


def _above_9(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class Browser:
    """One headless Chromium; ``visit(path)`` opens a file in a fresh tab."""

    def __init__(self, executable: str, timeout: float = 30.0):
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="torchautopsy-chromium-")
        cmd_r, self._cmd_w = os.pipe()  # we write commands, the browser reads fd 3
        self._out_r, out_w = os.pipe()  # the browser writes fd 4, we read
        cmd_r, out_w = _above_9(cmd_r), _above_9(out_w)  # never 3 or 4 themselves
        args = [executable, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--hide-scrollbars", "--mute-audio", f"--user-data-dir={self.profile}"]
        # bash puts our pipe ends on fds 3 and 4 of the browser (sh may not handle fds above 9).
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{cmd_r} 4>&{out_w} {cmd_r}<&- {out_w}>&-', *args],
            pass_fds=(cmd_r, out_w), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._next_id = 0
        self._events: list[dict] = []

    # -- protocol ---------------------------------------------------------------------------------
    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._note(reply)

    def _receive(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from Chromium")
            ready, _, _ = select.select([self._out_r], [], [], 0.5)
            if ready:
                chunk = os.read(self._out_r, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed the DevTools pipe (did it crash?)")
                self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def _wait_for(self, method: str, session: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not any(e.get("method") == method and e.get("sessionId") == session for e in self._events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Chromium sent no {method}")
            self._note(self._receive())

    def _note(self, event: dict) -> None:
        """Keep an event; a dialog (an alert() that ran) is recorded and dismissed at once, as it
        would otherwise hold the page's load forever."""
        self._events.append(event)
        if event.get("method") == "Page.javascriptDialogOpening":
            self._send("Page.handleJavaScriptDialog", {"accept": True}, event.get("sessionId"))

    # -- a visit ----------------------------------------------------------------------------------
    def visit(self, path: Path, queries: tuple[str, ...] = (), width: int = 1200,
              settle_s: float = 0.3) -> PageVisit:
        url = Path(path).resolve().as_uri()
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Network", "Runtime", "Log"):
            self._send(f"{domain}.enable", session=session)
        self._events.clear()
        self._send("Emulation.setDeviceMetricsOverride",
                   {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session)
        self._send("Page.navigate", {"url": url}, session)
        self._wait_for("Page.loadEventFired", session)
        end = time.monotonic() + settle_s  # late requests or errors after load
        while time.monotonic() < end:
            try:
                self._send("Runtime.evaluate", {"expression": "1"}, session)
            except TimeoutError:
                break
            time.sleep(0.05)
        visit = PageVisit(url)
        for e in self._events:
            if e.get("sessionId") != session:
                continue
            p = e.get("params", {})
            m = e.get("method")
            if m == "Network.requestWillBeSent":
                visit.requests.append(p["request"]["url"])
            elif m == "Runtime.consoleAPICalled":
                visit.console.append((p.get("type", ""), " ".join(str(a.get("value", a.get("description", "")))
                                                                   for a in p.get("args", []))))
            elif m == "Log.entryAdded":
                entry = p.get("entry", {})
                visit.console.append((entry.get("level", ""), entry.get("text", "")))
            elif m == "Runtime.exceptionThrown":
                visit.exceptions.append(json.dumps(p.get("exceptionDetails", {}))[:500])
            elif m == "Page.javascriptDialogOpening":
                visit.dialogs.append(p.get("message", ""))
        visit.text = self._eval("document.body ? document.body.innerText : ''", session)
        for q in queries:
            visit.counts[q] = self._eval(f"document.querySelectorAll({json.dumps(q)}).length", session)
        visit.broken_images = self._eval(
            "Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0).length", session)
        height = int(self._eval("Math.ceil(document.documentElement.scrollHeight)", session))
        self._send("Emulation.setDeviceMetricsOverride",
                   {"width": width, "height": min(max(height, 100), 16000), "deviceScaleFactor": 1,
                    "mobile": False}, session)
        shot = self._send("Page.captureScreenshot", {"format": "png"}, session)
        visit.screenshot = base64.b64decode(shot["data"])
        self._send("Target.closeTarget", {"targetId": target})
        return visit

    def _eval(self, expression: str, session: str):
        r = self._send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        return r.get("result", {}).get("value")

    def close(self) -> None:
        try:
            self._send("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._cmd_w, self._out_r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
