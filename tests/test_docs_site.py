"""The built documentation site, as a reader's browser shows it.

Run after the README's docs command has built ``docs/_build/html`` (``.ci/run`` builds it, then runs
this file); skipped when the site is not built or Debian's ``chromium`` is missing.

Headless Chromium opens the home page and lesson 04's page over the DevTools protocol, through
``--remote-debugging-pipe`` (requests and replies as NUL-separated JSON on file descriptors 3 and 4: no
port, no websocket, nothing outside the standard library), and reports what the page's own
``document.images`` says once the page's load event has fired: an image counts as shown when it is
``complete`` with a non-zero ``naturalWidth`` and ``naturalHeight``, which a missing or broken file
never has. Screenshots of both pages go to ``docs/_build/screenshots/``.
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "_build" / "html"
SHOTS = ROOT / "docs" / "_build" / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LESSON = "04_pipeline"  # the lesson page the browser checks: its picture must be shown

pytestmark = [
    pytest.mark.skipif(not (SITE / "index.html").is_file(),
                       reason="the site is not built: run the README's docs command (python -m sphinx ... docs docs/_build/html)"),
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install -y chromium)"),
]

IMAGES = ("JSON.stringify(Array.from(document.images, i => ({src: i.getAttribute('src'), complete: i.complete,"
          " width: i.naturalWidth, height: i.naturalHeight})))")


class Browser:
    """Headless Chromium driven over ``--remote-debugging-pipe``: one tab, commands answered in order."""

    def __init__(self, width: int = 1280, height: int = 900):
        self.profile = tempfile.mkdtemp(prefix="minidist-chromium-")
        to_browser, self._send = os.pipe()  # Chromium reads commands on its fd 3 ...
        self._receive, from_browser = os.pipe()  # ... and writes replies and events on its fd 4
        # its ends moved above 4 first, so that dup2 below always makes a new, inheritable descriptor
        to_browser, from_browser = (self._above_4(fd) for fd in (to_browser, from_browser))

        def pipes_at_3_and_4():
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--hide-scrollbars", "--remote-debugging-pipe", f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=pipes_at_3_and_4, close_fds=False)
        os.close(to_browser)
        os.close(from_browser)
        self._next_id, self._buffer = 0, b""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    @staticmethod
    def _above_4(fd: int) -> int:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(fd)
        return high

    def _message(self, timeout: float = 60.0) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._receive], [], [], timeout)
            chunk = os.read(self._receive, 1 << 20) if ready else b""
            if not chunk:
                raise RuntimeError("chromium said nothing within a minute, or closed its pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: bool = False, wait_for: str | None = None, **params) -> dict:
        """Send one command and return its result; with ``wait_for``, also wait for that event."""
        self._next_id += 1
        request = {"id": self._next_id, "method": method, "params": params}
        if session:
            request["sessionId"] = self.session
        os.write(self._send, json.dumps(request).encode() + b"\0")
        result, seen = None, wait_for is None
        while result is None or not seen:
            message = self._message()
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result = message["result"]
            elif wait_for is not None and message.get("method") == wait_for:
                seen = True
        return result

    def open(self, path: Path) -> None:
        self.call("Page.navigate", session=True, wait_for="Page.loadEventFired", url=path.as_uri())

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                         awaitPromise=True)["result"].get("value")

    def screenshot(self, into: Path) -> None:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        into.parent.mkdir(parents=True, exist_ok=True)
        into.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._send)
        os.close(self._receive)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


def shown(browser) -> list[dict]:
    return json.loads(browser.evaluate(IMAGES))


def test_the_home_page_opens_with_its_title_and_every_image_shown(browser):
    browser.open(SITE / "index.html")
    assert browser.evaluate("document.title").startswith("minidist")
    assert "See and run how large-language-model training is distributed" in browser.evaluate("document.body.innerText")
    images = shown(browser)
    assert images, "the home page shows no image"
    for image in images:
        assert image["complete"] and image["width"] > 0 and image["height"] > 0, f"not shown: {image}"
    browser.screenshot(SHOTS / "home.png")
    assert (SHOTS / "home.png").stat().st_size > 10_000


def test_a_lesson_page_shows_its_picture_its_output_and_its_code(browser):
    browser.open(SITE / "lessons" / f"{LESSON}.html")
    text = browser.evaluate("document.body.innerText")
    assert "Lesson 4: pipeline parallelism" in text
    assert f"python tutorials/{LESSON}.py --png" in text  # the run that built the page
    pictures = [i for i in shown(browser) if i["src"].endswith(f"{LESSON}.png")]
    assert len(pictures) == 1, f"lesson {LESSON}'s page has no picture of its own: {shown(browser)}"
    picture = pictures[0]
    assert picture["complete"] and picture["width"] > 0 and picture["height"] > 0, f"its picture is not shown: {picture}"
    browser.evaluate("document.querySelector('img.lesson-picture').scrollIntoView({block: 'center'})")
    browser.screenshot(SHOTS / "lesson.png")
    assert (SHOTS / "lesson.png").stat().st_size > 10_000


def test_every_lesson_has_a_page_named_by_its_number_with_its_picture_or_the_reason():
    for script in sorted(ROOT.glob("tutorials/[0-9][0-9]_*.py")):
        page = SITE / "lessons" / f"{script.stem}.html"
        assert page.is_file(), f"no page for {script.name}"
        html = page.read_text(encoding="utf-8")
        images = [re.search(r'src="([^"]+)"', tag).group(1)
                  for tag in re.findall(r"<img [^>]*>", html) if re.search(r'class="[^"]*\blesson-picture\b', tag)]
        if script.name.startswith("08_") and not images:  # needs a GPU: says so in one line, draws nothing
            assert "needs CuPy and an NVIDIA GPU" in html and "No picture:" in html
            continue
        if script.name.startswith("21_") and not images:  # needs Open MPI's ULFM: says so in one line, draws nothing
            assert "Lesson 21 needs Open MPI 5" in html and "fault-tolerance interface (ULFM)" in html \
                and "No picture:" in html
            continue
        assert len(images) == 1, f"{page.name}: {images}"
        assert (page.parent / images[0]).stat().st_size > 0
