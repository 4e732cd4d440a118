"""A headless Chromium of our own, driven through Playwright, for WebArena episodes.

Process. We start Debian's Chromium ourselves (never a browser Playwright downloads) with
CHROMIUM_FLAGS, a fresh temporary profile and a DevTools port on loopback (open to local
processes while the browser runs), and attach Playwright to it over CDP. Owning the process is what makes cleanup certain: close() ends its
whole process group and deletes the profile, whatever state Playwright is in; a finalizer does
the same if close() is never called; and where util-linux's setpriv exists, Chromium is started
with a parent-death signal, so it dies with us even if Python is killed.

Thread. Playwright's sync API must be called from one thread, and refuses to run inside an
asyncio loop (a notebook). Every browser call therefore runs on a thread this object owns;
callers may use any thread.

Episodes. Each episode gets a new browser context (fresh cookies and storage, the task's login
state), with one tab per start URL. After an action we wait until the active tab is settled:
`settle_s` for the action's effects to begin, then until a navigation that started has
committed and loaded (WebArena sleeps a fixed time instead).

Element actions (click, type, hover) address elements by the ids of the last observation. As
WebArena does, they act with the mouse at the centre of the element's box; we first scroll the
element into view and measure it again, so an id read from a full-page tree works too, and
an element the page has since removed is reported instead of clicking where it was.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.parse
import weakref
from typing import Any, Callable, Mapping, Sequence, TypeVar

from environments.base import EnvError
from environments.webarena import accessibility, evaluators
from environments.webarena.actions import Action

DEFAULT_EXECUTABLE = "/usr/bin/chromium"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-default-browser-check",
    "--disable-extensions",
    "--password-store=basic",
    # Containers often have a tiny /dev/shm.
    "--disable-dev-shm-usage",
    # Some of the switches Playwright's own launcher adds. Without the back-forward cache, going
    # back reloads the page and fires "load" (a restored page never does, and go_back waits).
    "--disable-back-forward-cache",
    # Keep http:// sites (WebArena's) on http, whatever HTTPS-First mode would do.
    "--disable-features=HttpsUpgrades,HttpsFirstBalancedModeAutoEnable",
    # Links may open tabs, and tabs in the background keep running.
    "--disable-popup-blocking",
    "--disable-renderer-backgrounding",
    "--disable-background-timer-throttling",
    "--disable-backgrounding-occluded-windows")
# goto may open only these; file: and chrome: URLs would let the agent read the machine.
GOTO_SCHEMES = ("http", "https")
_SCROLL = "down => { const s = document.scrollingElement || document.body; " \
          "s.scrollTop += (down ? 1 : -1) * window.innerHeight; }"
_POLL_MS = 50
_CLOSE_GRACE_S = 10.0

_T = TypeVar("_T")


class ActionFailed(Exception):
  """An action the page could not carry out; the message is shown to the model."""


@dataclasses.dataclass(frozen=True)
class View:
  """What the agent sees of the browser: the tabs, the active tab's tree and URL."""

  tabs: str
  tree: str
  url: str


def _on_browser_thread(method: Callable[..., _T]) -> Callable[..., _T]:
  """Runs the method on the browser's own thread (module docstring)."""

  @functools.wraps(method)
  def call(self: "Browser", *args: Any, **kwargs: Any) -> _T:
    if threading.current_thread() is self._thread:
      return method(self, *args, **kwargs)
    if self._closed:
      raise EnvError("the WebArena browser is closed")
    return self._executor.submit(method, self, *args, **kwargs).result()

  return call


class Browser:
  """One Chromium with one episode (browser context) at a time; started on first use."""

  def __init__(self, executable: str = DEFAULT_EXECUTABLE, *,
               viewport: tuple[int, int] = (1280, 720), viewport_only: bool = True,
               settle_s: float = 0.2, timeout_s: float = 30.0, start_timeout_s: float = 60.0):
    """Configures the browser; nothing starts until the first episode.

    Args:
      executable: the Chromium binary.
      viewport: the page size (width, height) in CSS pixels.
      viewport_only: observe only what is in the viewport (scroll to see the rest).
      settle_s: how long to let an action's effects begin before observing.
      timeout_s: the limit of one page operation (a navigation, a wait for load).
      start_timeout_s: the limit for Chromium to start.
    """
    if viewport[0] <= 0 or viewport[1] <= 0 or settle_s < 0 or timeout_s <= 0:
      raise ValueError(f"need a positive viewport and timeout and settle_s >= 0; got "
                       f"{viewport}, {timeout_s}, {settle_s}")
    self.executable = executable
    self.viewport = viewport
    self.viewport_only = viewport_only
    self._settle_ms = settle_s * 1000
    self._timeout_s = timeout_s
    self._start_timeout_s = start_timeout_s
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                           thread_name_prefix="webarena-browser")
    self._thread = self._executor.submit(threading.current_thread).result()
    self._closed = False
    self._process: subprocess.Popen | None = None
    self._profile = ""
    self._finalizer: weakref.finalize | None = None
    self._playwright: Any = None
    self._browser: Any = None
    self._context: Any = None
    self._page: Any = None
    self._sessions: dict[Any, Any] = {}  # page -> its CDP session
    self._navigations: dict[Any, set[Any]] = {}  # page -> main-frame requests not committed
    self._elements: dict[str, accessibility.Element] = {}

  @property
  def profile_dir(self) -> str:
    """The running Chromium's profile directory ("" before it starts)."""
    return self._profile

  # Episodes.

  @_on_browser_thread
  def start_episode(self, start_urls: Sequence[str], storage_state: str | None = None,
                    geolocation: Mapping[str, float] | None = None) -> None:
    """Opens a fresh context with one tab per start URL; the first tab is active."""
    if self._browser is None:
      self._launch()
    self._close_context()
    from playwright.sync_api import Error as PlaywrightError
    try:
      self._context = self._browser.new_context(
          viewport={"width": self.viewport[0], "height": self.viewport[1]}, device_scale_factor=1,
          storage_state=storage_state, geolocation=geolocation)
      self._context.set_default_timeout(self._timeout_s * 1000)
      self._context.on("page", self._track)
      for url in start_urls:
        self._context.new_page().goto(url)
      self._page = self._context.pages[0]
      self._page.bring_to_front()
    except PlaywrightError as e:
      raise EnvError(f"cannot open the start page(s) {list(start_urls)}: {_first_line(e)}")
    self._elements = {}

  @_on_browser_thread
  def observe(self) -> View:
    """The open tabs and the active tab's accessibility tree, whose ids actions may name."""
    page, context = self._page, self._context
    titles = [_title(tab) for tab in context.pages]
    tabs = " | ".join(f"Tab {i} (current): {title}" if tab is page else f"Tab {i}: {title}"
                      for i, (tab, title) in enumerate(zip(context.pages, titles)))
    nodes, bounds = self._fetch_tree(page)
    tree, self._elements = accessibility.render(nodes, bounds,
                                                self.viewport if self.viewport_only else None)
    return View(tabs, tree, page.url)

  @_on_browser_thread
  def execute(self, action: Action) -> None:
    """Carries out a non-stop action; raises ActionFailed with a reason for the model."""
    from playwright.sync_api import Error as PlaywrightError
    try:
      self._execute(action)
    except PlaywrightError as e:
      raise ActionFailed(_first_line(e)) from None
    self._settle()

  def element_description(self, element_id: str) -> str:
    """The observation line of an element of the last observation ("" if none)."""
    element = self._elements.get(element_id)
    return element.description if element is not None else ""

  @_on_browser_thread
  def evaluate_task(self, config: Mapping[str, Any], answer: str) -> evaluators.Evaluation:
    """Runs the task's evaluators on the active tab."""
    return evaluators.evaluate(config, answer, _ActiveTab(self))

  def close(self) -> None:
    """Disconnects, ends Chromium's process group, deletes the profile. Idempotent."""
    if self._closed:
      return
    self._closed = True
    disconnect = self._executor.submit(self._disconnect)
    try:  # A hung browser thread must not keep Chromium alive: the kill below unblocks it.
      disconnect.result(timeout=_CLOSE_GRACE_S)
    except Exception:  # Whatever Playwright says while closing, the kill is what counts.
      pass
    if self._finalizer is not None:
      self._finalizer()
    self._executor.shutdown(wait=False, cancel_futures=True)

  # Browser thread.

  def _launch(self) -> None:
    try:
      from playwright.sync_api import Error as PlaywrightError
      from playwright.sync_api import sync_playwright
    except ImportError:
      raise EnvError("the WebArena browser needs the playwright package: pip install "
                     "'agentgym-jax[webarena]' (it drives our Chromium; skip `playwright "
                     "install`)") from None
    if not (os.path.isfile(self.executable) and os.access(self.executable, os.X_OK)):
      raise EnvError(f"Chromium is not installed at {self.executable}; install Debian's "
                     "package (apt-get install -y chromium) or pass executable=...")
    self._profile = tempfile.mkdtemp(prefix="agentgym-webarena-chromium-")
    command = [
        self.executable, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile}",
        "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "about:blank"
    ]
    setpriv = shutil.which("setpriv")
    if setpriv:
      command = [setpriv, "--pdeathsig", "KILL", "--", *command]
    log_path = os.path.join(self._profile, "chromium.log")
    with open(log_path, "wb") as log:
      self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       start_new_session=True)
    self._finalizer = weakref.finalize(self, _terminate, self._process, self._profile)
    try:
      port = self._wait_for_port(log_path)
      self._playwright = sync_playwright().start()
      self._browser = self._playwright.chromium.connect_over_cdp(
          f"http://127.0.0.1:{port}", timeout=self._start_timeout_s * 1000)
    except (EnvError, PlaywrightError) as e:  # Leave nothing behind; the next reset retries.
      self._disconnect()
      self._finalizer()
      if isinstance(e, EnvError):
        raise
      raise EnvError(f"cannot attach Playwright to Chromium: {_first_line(e)}") from None

  def _wait_for_port(self, log_path: str) -> str:
    """The DevTools port Chromium writes into its profile once it listens."""
    port_file = os.path.join(self._profile, "DevToolsActivePort")
    deadline = time.monotonic() + self._start_timeout_s
    while time.monotonic() < deadline:
      if self._process.poll() is not None:
        with open(log_path, errors="replace") as log:
          tail = log.read()[-2000:]
        raise EnvError(f"Chromium exited with code {self._process.returncode} at start:\n{tail}")
      try:
        with open(port_file) as f:
          port = f.readline().strip()
        if port:
          return port
      except FileNotFoundError:
        pass
      time.sleep(0.02)
    raise EnvError(f"Chromium did not open its DevTools port within {self._start_timeout_s} s")

  def _track(self, page: Any) -> None:
    """Follows a tab's main-frame navigations, so `_settle` knows when one is under way."""
    pending: set[Any] = set()
    self._navigations[page] = pending

    def on_request(request: Any) -> None:
      if request.is_navigation_request() and request.frame == page.main_frame:
        pending.add(request)

    def on_response(response: Any) -> None:
      if response.status in (204, 205):  # No content: the tab stays where it was.
        pending.discard(response.request)

    page.on("request", on_request)
    page.on("response", on_response)
    page.on("requestfailed", lambda request: pending.discard(request))
    page.on("framenavigated", lambda frame: pending.clear() if frame == page.main_frame else None)
    page.on("close", lambda _: self._forget(page))

  def _forget(self, page: Any) -> None:
    self._navigations.pop(page, None)
    self._sessions.pop(page, None)

  def _settle(self) -> None:
    """Waits for the active tab to finish what the last action started."""
    from playwright.sync_api import Error as PlaywrightError
    page = self._page
    deadline = time.monotonic() + self._timeout_s
    try:
      page.wait_for_timeout(self._settle_ms)
      while self._navigations.get(page) and time.monotonic() < deadline:
        page.wait_for_timeout(_POLL_MS)
      page.wait_for_load_state("load", timeout=max(deadline - time.monotonic(), 0.1) * 1000)
    except PlaywrightError:  # A page still loading is observed as it is, as in WebArena.
      pass

  def _session(self, page: Any) -> Any:
    if page not in self._sessions:
      session = self._context.new_cdp_session(page)
      session.send("Accessibility.enable")
      self._sessions[page] = session
    return self._sessions[page]

  def _fetch_tree(self, page: Any) -> tuple[list[dict[str, Any]], dict[int, Any] | None]:
    from playwright.sync_api import Error as PlaywrightError
    try:
      return self._read_tree(page)
    except PlaywrightError:  # The document changed under us: once more when it has loaded.
      self._sessions.pop(page, None)
      try:
        page.wait_for_load_state("load")
      except PlaywrightError:
        pass
    try:
      return self._read_tree(page)
    except PlaywrightError as e:
      raise EnvError(f"cannot read the page's accessibility tree: {_first_line(e)}") from None

  def _read_tree(self, page: Any) -> tuple[list[dict[str, Any]], dict[int, Any] | None]:
    session = self._session(page)
    nodes = session.send("Accessibility.getFullAXTree")["nodes"]
    if not self.viewport_only:
      return nodes, None
    snapshot = session.send("DOMSnapshot.captureSnapshot",
                            {"computedStyles": [], "includeDOMRects": True})
    return nodes, accessibility.layout_bounds(snapshot)

  def _execute(self, action: Action) -> None:
    page = self._page
    match action.kind:
      case "click" | "hover" | "type":
        x, y = self._element_centre(action.element_id)
        if action.kind == "hover":
          page.mouse.move(x, y)
          return
        page.mouse.click(x, y)
        if action.kind == "type":
          page.keyboard.type(action.text)
          if action.press_enter:
            page.keyboard.press("Enter")
      case "press":
        page.keyboard.press(action.key_comb)
      case "scroll":
        page.evaluate(_SCROLL, action.direction == "down")
      case "new_tab":
        self._switch_to(self._context.new_page())
      case "tab_focus":
        pages = self._context.pages
        if not 0 <= action.tab_index < len(pages):
          raise ActionFailed(f"there is no tab {action.tab_index}; the tabs are numbered 0 to "
                             f"{len(pages) - 1}")
        self._switch_to(pages[action.tab_index])
      case "close_tab":
        page.close()
        pages = self._context.pages
        self._switch_to(pages[-1] if pages else self._context.new_page())
      case "goto":
        scheme = urllib.parse.urlsplit(action.url).scheme.lower()
        if scheme not in GOTO_SCHEMES:
          raise ActionFailed(f"goto opens only {' and '.join(GOTO_SCHEMES)} URLs, not "
                             f"{action.url!r}")
        page.goto(action.url)
      case "go_back":
        page.go_back()
      case "go_forward":
        page.go_forward()
      case _:
        raise ValueError(f"the browser does not execute {action.kind!r} actions")

  def _switch_to(self, page: Any) -> None:
    self._page = page
    self._elements = {}
    page.bring_to_front()

  def _element_centre(self, element_id: str) -> tuple[float, float]:
    """The viewport point at the centre of an element, scrolled into view first."""
    from playwright.sync_api import Error as PlaywrightError
    element = self._elements.get(element_id)
    if element is None:
      raise ActionFailed(f"there is no element [{element_id}] in the current observation")
    session = self._session(self._page)
    node = {"backendNodeId": element.backend_node_id}
    try:
      session.send("DOM.scrollIntoViewIfNeeded", node)
      quads = session.send("DOM.getContentQuads", node)["quads"]
    except PlaywrightError:
      raise ActionFailed(f"element [{element_id}] is no longer on the page") from None
    for quad in quads:
      xs, ys = quad[0::2], quad[1::2]
      if max(xs) - min(xs) > 0 and max(ys) - min(ys) > 0:
        return sum(xs) / 4, sum(ys) / 4
    raise ActionFailed(f"element [{element_id}] is not visible")

  def _close_context(self) -> None:
    if self._context is not None:
      context, self._context, self._page = self._context, None, None
      self._sessions.clear()
      self._navigations.clear()
      try:
        context.close()
      except Exception:  # A crashed context is gone either way.
        pass

  def _disconnect(self) -> None:
    self._close_context()
    for closing in (self._browser, self._playwright):
      if closing is not None:
        try:
          closing.close() if closing is self._browser else closing.stop()
        except Exception:  # Chromium may already be gone; the process kill follows.
          pass
    self._browser = self._playwright = None


class _ActiveTab:
  """The evaluators' `Page`: the active tab, used on the browser thread."""

  def __init__(self, browser: Browser):
    self._browser = browser

  @property
  def url(self) -> str:
    return self._browser._page.url

  def goto(self, url: str) -> None:
    self._browser._page.goto(url)

  def evaluate(self, expression: str) -> Any:
    return self._browser._page.evaluate(f"() => {expression}")

  def content(self) -> str:
    return self._browser._page.content()


def _terminate(process: subprocess.Popen, profile: str) -> None:
  """Ends Chromium's process group (politely, then not) and deletes its profile."""
  for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL also reaches helpers left behind.
    try:
      os.killpg(process.pid, sig)
    except ProcessLookupError:
      pass
    try:
      process.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
      pass
  shutil.rmtree(profile, ignore_errors=True)


def _title(page: Any) -> str:
  try:
    return page.title()
  except Exception:  # A tab mid-navigation has no title yet.
    return ""


def _first_line(error: BaseException) -> str:
  lines = str(error).strip().splitlines()
  text = lines[0] if lines else type(error).__name__
  return text.removeprefix("Error: ")[:300]
