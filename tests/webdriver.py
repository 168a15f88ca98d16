"""A small W3C WebDriver client on httpx, for the dashboard's browser test.

It drives Debian's `chromium` through `chromedriver` (package
`chromium-driver`) with the handful of commands the test needs, so the test
suite needs no browser-automation package. `ensure_chromium()` installs the
two Debian packages when they are missing and apt-get may run.
"""
from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"   # the W3C key of an element reference
APT_PACKAGES = ("chromium", "chromium-driver", "fonts-liberation")   # a font, so screenshots show text


class NoBrowser(RuntimeError):
    """No headless Chromium can be found or installed here."""


def _find() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def ensure_chromium(timeout_s: float = 900.0) -> tuple[str, str]:
    """(browser, driver) paths; installs Debian's packages with apt-get if needed (root only)."""
    found = _find()
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None:
        raise NoBrowser("chromium/chromedriver are not installed and there is no apt-get to install them")
    if os.geteuid() != 0:
        raise NoBrowser("chromium/chromedriver are not installed; run as root, or "
                        f"`apt-get install {' '.join(APT_PACKAGES)}` first")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]):
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise NoBrowser(f"`{' '.join(cmd)}` did not finish in {timeout_s:.0f} s") from None
        if r.returncode != 0:
            raise NoBrowser(f"`{' '.join(cmd)}` failed ({r.returncode}): {(r.stderr or r.stdout)[-500:]}")
    found = _find()
    if not found:
        raise NoBrowser(f"installed {' '.join(APT_PACKAGES)} but chromium/chromedriver are still not on PATH")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebDriverError(RuntimeError):
    pass


class Browser:
    """One headless Chromium session through chromedriver."""

    def __init__(self, browser: str, driver: str, width: int = 1400, height: int = 1800):
        port = _free_port()
        self._proc = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        deadline = time.monotonic() + 30
        while True:
            try:
                if self._http.get("/status").json()["value"]["ready"]:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self._proc.poll() is not None:
                self._proc.kill()
                raise WebDriverError("chromedriver did not start")
            time.sleep(0.1)
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--no-first-run", "--disable-extensions"]
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome",
                                                 "goog:chromeOptions": {"binary": browser, "args": args}}}}
        try:
            self.session = self._call("POST", "/session", caps)["sessionId"]
        except BaseException:
            self._proc.kill()
            raise

    def _call(self, method: str, path: str, body: dict | None = None):
        r = self._http.request(method, path, json=body)
        value = r.json().get("value")
        if r.status_code != 200:
            msg = value.get("message", "") if isinstance(value, dict) else value
            raise WebDriverError(f"{method} {path}: {r.status_code} {str(msg)[:500]}")
        return value

    def _s(self, path: str) -> str:
        return f"/session/{self.session}{path}"

    def get(self, url: str) -> None:
        self._call("POST", self._s("/url"), {"url": url})

    def find(self, css: str) -> str:
        return self._call("POST", self._s("/element"), {"using": "css selector", "value": css})[ELEMENT]

    def click(self, css: str) -> None:
        self._call("POST", self._s(f"/element/{self.find(css)}/click"), {})

    def type(self, css: str, text: str, clear: bool = True) -> None:
        eid = self.find(css)
        if clear:
            self._call("POST", self._s(f"/element/{eid}/clear"), {})
        self._call("POST", self._s(f"/element/{eid}/value"), {"text": text})

    def js(self, script: str, *args):
        """Run `script` as a function body in the page; its return value comes back."""
        return self._call("POST", self._s("/execute/sync"), {"script": script, "args": list(args)})

    def wait_for(self, script: str, *args, timeout: float = 120.0, what: str = "the condition"):
        """Poll a page expression until it returns something truthy; return that."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(script, *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self._call("GET", self._s("/screenshot"))))
        return path

    def close(self) -> None:
        try:
            self._call("DELETE", self._s(""))
        except (WebDriverError, httpx.HTTPError):
            pass
        finally:
            self._http.close()
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
