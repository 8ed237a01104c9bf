"""A headless Chromium driven over the DevTools protocol on a pipe, with the standard library only:
open a page, collect its console errors, evaluate JavaScript, take a full-page screenshot.

Chromium's ``--remote-debugging-pipe`` reads JSON commands on file descriptor 3 and writes JSON
replies and events on descriptor 4, each message ended by a NUL byte (as Puppeteer drives Chrome):
no port, no websocket, no driver package.

    with Chromium() as browser:
        page = browser.open("file:///tmp/report.html")
        page.evaluate("document.title"), page.errors
        page.screenshot("/tmp/report.png")
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time


def find_chromium() -> str | None:
    """The Chromium (or Chrome) executable on this machine, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


class BrowserError(RuntimeError):
    """Chromium answered a command with an error, exited, or did not answer in time."""


class Chromium:
    """One headless Chromium process with a throwaway profile; a context manager."""

    def __init__(self, executable: str | None = None, timeout: float = 60.0,
                 window: tuple[int, int] = (1400, 900)):
        self.executable = executable or find_chromium()
        if self.executable is None:
            raise BrowserError("no chromium on PATH (Debian: apt-get install chromium)")
        self.timeout, self.window = timeout, window
        self._next_id, self._buffer, self._events = 0, b"", []

    def __enter__(self) -> Chromium:
        self._profile = tempfile.mkdtemp(prefix="rlhf-chromium-")
        to_browser, self._commands = os.pipe()   # we write commands, Chromium reads fd 3
        self._replies, from_browser = os.pipe()  # Chromium writes fd 4, we read replies

        def on_fds_3_and_4():  # in the child, between fork and exec
            # through fds >= 10 first: a pipe end that is already 3 or 4 is not overwritten
            for fd, target in ((to_browser, 3), (from_browser, 4)):
                high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
                os.dup2(high, target)
                os.close(high)

        flags = ["--headless", "--remote-debugging-pipe", f"--user-data-dir={self._profile}",
                 "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                 f"--window-size={self.window[0]},{self.window[1]}", "--hide-scrollbars",
                 "--disable-dev-shm-usage"]  # a container's /dev/shm (Docker: 64 MB) is too small
        if os.geteuid() == 0:  # Chromium's sandbox refuses root (CI containers run as root)
            flags.append("--no-sandbox")
        # its log goes to a file: a pipe nobody reads would stall it once full
        self._log = open(os.path.join(self._profile, "stderr.log"), "w+b")
        try:  # a session of its own: its zygote and renderers are killed with it
            self._process = subprocess.Popen([self.executable, *flags, "about:blank"],
                                             preexec_fn=on_fds_3_and_4, close_fds=False,
                                             start_new_session=True, stdin=subprocess.DEVNULL,
                                             stdout=self._log, stderr=self._log)
        except BaseException:
            for fd in (self._commands, self._replies):
                os.close(fd)
            self._log.close()
            shutil.rmtree(self._profile, ignore_errors=True)
            raise
        finally:
            os.close(to_browser)
            os.close(from_browser)
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._process.poll() is None:
                self.send("Browser.close")
                self._process.wait(timeout=10)
        except (BrowserError, subprocess.TimeoutExpired, OSError):
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._process.wait()
        finally:
            os.close(self._commands)
            os.close(self._replies)
            self._log.close()
            shutil.rmtree(self._profile, ignore_errors=True)

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and return its result; events that arrive meanwhile are kept."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply["result"]
            self._events.append(reply)

    def wait_for(self, method: str, session: str | None = None) -> dict:
        """The first event named ``method`` (already received or the next to come)."""
        deadline = time.monotonic() + self.timeout
        while True:
            for event in self._events:
                if event.get("method") == method and event.get("sessionId") == session:
                    self._events.remove(event)
                    return event["params"]
            if time.monotonic() > deadline:
                raise BrowserError(f"no {method} in {self.timeout:.0f} s")
            self._events.append(self._receive())

    def events(self, session: str) -> list[dict]:
        """The events received so far for ``session``."""
        return [e for e in self._events if e.get("sessionId") == session]

    def _receive(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise BrowserError(f"chromium did not answer in {self.timeout:.0f} s")
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                self._log.seek(0)
                log = self._log.read().decode(errors="replace")[-2000:]
                raise BrowserError(f"chromium exited (status {self._process.wait()}):\n{log}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, url: str) -> Page:
        """A new tab showing ``url``, loaded (its ``load`` event fired)."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=session)
        if error := self.send("Page.navigate", {"url": url}, session).get("errorText"):
            raise BrowserError(f"{url}: {error}")  # e.g. net::ERR_FILE_NOT_FOUND
        self.wait_for("Page.loadEventFired", session)
        return Page(self, session)


class Page:
    """A loaded tab of :class:`Chromium`."""

    def __init__(self, browser: Chromium, session: str):
        self.browser, self.session = browser, session

    def evaluate(self, expression: str):
        """The value of a JavaScript expression (a promise is awaited), as JSON gives it back."""
        result = self.browser.send("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": True}, self.session)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    @property
    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and errors the browser logged (failed loads, ...)."""
        out = []
        for event in self.browser.events(self.session):
            method, params = event["method"], event["params"]
            if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                out.append("console." + params["type"] + ": " + " ".join(
                    str(a.get("value", a.get("description", ""))) for a in params["args"]))
            elif method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                out.append("uncaught: " + details.get("exception", {}).get("description",
                                                                             details["text"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                out.append(f"{params['entry']['source']}: {params['entry']['text']}")
        return out

    def screenshot(self, path: str) -> None:
        """A PNG of the whole page, not only the window, at the window's width."""
        size = self.browser.send("Page.getLayoutMetrics", session=self.session)["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        data = self.browser.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True, "clip": clip}, self.session)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
