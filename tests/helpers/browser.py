"""A real headless Chromium for the tests, driven by ``tests/browser/driver.mjs``.

Debian's ``/usr/bin/chromium`` started by Playwright's ``playwright-core`` from Node
(``npm ci --prefix tests/browser``). Missing pieces skip the test with the reason, except
under ``CI=true``, where they fail it: CI installs them (``tools/install_browser.sh``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

BROWSER_DIR = ROOT / "tests" / "browser"
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = ROOT / "test-artifacts"
"""Screenshots the browser tests keep (gitignored)."""


NODE_MAJOR = 20
"""The oldest Node.js that runs playwright-core (its ``engines``)."""


def node_version() -> tuple[int, ...] | None:
    """``node --version`` as numbers; None when it does not say."""
    try:
        out = subprocess.run(
            ["node", "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        return tuple(int(part) for part in out.lstrip("v").split("."))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def missing() -> str | None:
    """Why no browser test can run here, or None."""
    if not CHROMIUM.exists():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium; tools/install_browser.sh)"
    if shutil.which("node") is None:
        return f"no node (Node.js {NODE_MAJOR}+ runs playwright-core)"
    version = node_version()
    if version is None or version[0] < NODE_MAJOR:
        shown = ".".join(map(str, version)) if version else "unknown"
        return f"node {shown} is too old: playwright-core needs Node.js {NODE_MAJOR} or newer"
    if not (BROWSER_DIR / "node_modules" / "playwright-core").is_dir():
        return "playwright-core not installed: npm ci --prefix tests/browser"
    return None


def need_browser() -> None:
    """Skip the test without a browser; fail it under ``CI=true``."""
    why = missing()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser test cannot run in CI: {why}")
    pytest.skip(why)


class Browser:
    """One Chromium page; every call waits for its answer (``timeout_s``)."""

    def __init__(self, extra_args: tuple[str, ...] = ()) -> None:
        """``extra_args``: more Chromium flags (``--host-resolver-rules=...``)."""
        self.profile = tempfile.mkdtemp(prefix="streamrft-chromium-")
        self.proc = subprocess.Popen(
            ["node", str(BROWSER_DIR / "driver.mjs"), self.profile],
            env=os.environ | {"BROWSER_EXTRA_ARGS": json.dumps(list(extra_args))},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=BROWSER_DIR,
        )
        ready = self._answer()
        assert ready == "ready", ready

    def _answer(self):
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the browser driver ended: {self.proc.stderr.read()[-3000:]}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise AssertionError(f"browser: {reply['error']}")
        return reply["value"]

    def call(self, cmd: str, **args):
        self.proc.stdin.write(json.dumps({"cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def goto(self, url: str) -> None:
        self.call("goto", url=url)

    def eval(self, js: str):
        return self.call("eval", js=js)

    def wait(self, js: str, timeout_s: float, what: str):
        """Wait until the expression ``js`` is truthy in the page; its value."""
        try:
            return self.call("wait", js=js, timeout_ms=int(timeout_s * 1000))
        except AssertionError as exc:
            raise AssertionError(f"the page never showed {what}: {exc}") from exc

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / name
        self.call("screenshot", path=str(path))
        return path

    def errors(self) -> list[str]:
        return self.call("errors")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("close")
                self.proc.wait(timeout=20)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)
