"""The HTTP layer of the project's JSON servers: the AgentGym env server (server.py) and the
OpenAI-compatible policy server (agentgym_jax/serving.py).

A `Server` runs one thread per connection and tracks the open connections, so that shutdown can
drop them once the answers being written are done. A `Handler` reads requests off keep-alive
connections, refuses the bodies it will not read (411 chunked, 400 a bad Content-Length, 413 over
`max_body_bytes`) and answers in JSON, or in a server-sent-event stream. An app subclasses
`Handler` and fills in its hooks: `respond` answers a request, `error_payload` is its JSON body
for an error, and `ensure_ascii` says whether JSON escapes non-ASCII characters. The app itself
subclasses `App`, which builds its `Server` and gives it an address and `with app:` serving.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import socketserver
import sys
import threading
import time
from typing import Any, Iterator, Self

from absl import logging

# After refusing a body unread (411, 413, a bad length), how long and how much of it the server
# still reads and discards before closing; see Handler._drain_refused_body.
_DRAIN_S = 2.0
_DRAIN_BYTES = 64 << 20

# A request's answer: (HTTP status, JSON-serialisable payload), the byte chunks of an event
# stream, or None to close the connection without an answer (the client has left).
Answer = tuple[int, Any] | Iterator[bytes] | None


class HTTPError(Exception):
  """An error answer: an HTTP status and a message, plus a machine-readable code."""

  def __init__(self, status: int, message: str, code: str = "bad_request"):
    super().__init__(message)
    self.status = status
    self.message = message
    self.code = code


class Server(http.server.ThreadingHTTPServer):
  """One thread per connection; tracks open connections so that shutdown can drop them.

  Args:
    address: (host, port) to listen on; port 0 picks a free port.
    handler: the app's `Handler` subclass.
    app: the object the handler answers for (`Handler.respond` reaches it as `self.server.app`).
    name: the app's name in log lines.
    max_body_bytes: larger request bodies are refused with 413.
  """

  daemon_threads = True
  # socketserver's listen backlog of 5 overflows when many clients connect at once (every
  # worker of a pool at start-up), and the kernel then resets connections it could not queue.
  request_queue_size = socket.SOMAXCONN

  def __init__(self, address: tuple[str, int], handler: type[Handler], *, app: Any, name: str,
               max_body_bytes: int):
    self.app = app
    self.name = name
    self.max_body_bytes = max_body_bytes
    self._connections: set[socket.socket] = set()
    self._answering = 0  # Requests being answered now.
    self._connections_lock = threading.Condition()
    super().__init__(address, handler)

  def server_bind(self) -> None:
    # HTTPServer.server_bind resolves the host's FQDN, which can stall on a bad resolver.
    socketserver.TCPServer.server_bind(self)
    self.server_name, self.server_port = self.server_address[:2]

  def track(self, connection: socket.socket, open_: bool) -> None:
    with self._connections_lock:
      (self._connections.add if open_ else self._connections.discard)(connection)

  def handle_error(self, request: Any, client_address: Any) -> None:
    """A client gone mid-request is one log line; anything else keeps socketserver's report."""
    error = sys.exc_info()[1]
    if isinstance(error, (ConnectionError, TimeoutError)):
      logging.info("%s: client %s went away: %s", self.name, client_address, error)
      return
    super().handle_error(request, client_address)

  @contextlib.contextmanager
  def answering(self) -> Iterator[None]:
    """Marks a request being answered, which `drop_connections` lets finish."""
    with self._connections_lock:
      self._answering += 1
    try:
      yield
    finally:
      with self._connections_lock:
        self._answering -= 1
        self._connections_lock.notify_all()

  def drop_connections(self, grace_s: float) -> None:
    """Ends every connection, so that its handler thread exits, once the answers being written
    are done (waiting at most grace_s)."""
    with self._connections_lock:
      self._connections_lock.wait_for(lambda: not self._answering, timeout=grace_s)
      connections = list(self._connections)
    for connection in connections:
      with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)


class Handler(http.server.BaseHTTPRequestHandler):
  """Reads one request at a time off a keep-alive connection; answers JSON, or an event stream in
  chunked transfer encoding (the connection stays open for the next request)."""

  protocol_version = "HTTP/1.1"
  server_version = "agentgym-jax"
  timeout = 600  # seconds an idle keep-alive connection stays open
  ensure_ascii = True  # JSON answers escape non-ASCII characters (json.dumps's ensure_ascii)
  server: Server

  def respond(self, method: str, body: bytes) -> Answer:
    """The answer to the request whose line and headers are read (`self.path`, `self.headers`)
    and whose body is `body`."""
    raise NotImplementedError

  def error_payload(self, status: int, message: str, code: str) -> Any:
    """The JSON body of an error answer that the app did not write: a refused body, or a request
    the base class could not parse."""
    raise NotImplementedError

  def setup(self) -> None:
    super().setup()
    # Headers and body leave in separate writes; with Nagle's algorithm the second waits for
    # the client's delayed ACK (~40 ms per request).
    self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    self.server.track(self.connection, True)

  def finish(self) -> None:
    self.server.track(self.connection, False)
    super().finish()

  def do_GET(self) -> None:
    self._answer("GET")

  def do_POST(self) -> None:
    self._answer("POST")

  def do_PUT(self) -> None:
    self._answer("PUT")

  def do_DELETE(self) -> None:
    self._answer("DELETE")

  def do_PATCH(self) -> None:
    self._answer("PATCH")

  def _answer(self, method: str) -> None:
    try:
      body = self._read_body()
    except HTTPError as error:
      self.close_connection = True  # The unread body would be taken for the next request.
      self._send_json(error.status, self.error_payload(error.status, error.message, error.code))
      self._drain_refused_body()
      return
    with self.server.answering():
      answer = self.respond(method, body)
      if answer is None:
        self.close_connection = True
      elif isinstance(answer, tuple):
        self._send_json(*answer)
      else:
        self._send_stream(answer)

  def _read_body(self) -> bytes:
    if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
      raise HTTPError(411, "chunked bodies are not supported; send Content-Length",
                      "length_required")
    length_header = self.headers.get("Content-Length")
    if length_header is None:
      return b""
    # ASCII digits only, as HTTP has them: int() would also take a sign, "_" and other scripts'
    # digits.
    digits = length_header.strip(" \t")
    if not (digits.isascii() and digits.isdigit()):
      raise HTTPError(400, f"bad Content-Length {length_header[:40]!r}")
    length = int(digits)
    limit = self.server.max_body_bytes
    if length > limit:
      raise HTTPError(413, f"request body of {length} bytes is over the limit of {limit}",
                      "too_large")
    return self.rfile.read(length)

  def _drain_refused_body(self) -> None:
    """Reads and drops what the client still sends after a refusal, so that it gets the answer.

    A socket closed with unread data resets the connection, and a client still sending its
    body (http.client sends it all before reading) then fails with a broken pipe instead of
    reading our 4xx. So: stop sending, then read until the client closes, for at most
    _DRAIN_S seconds and _DRAIN_BYTES bytes.
    """
    deadline = time.monotonic() + _DRAIN_S
    drained = 0
    with contextlib.suppress(OSError):  # Reset by the client, or timed out: done either way.
      self.connection.shutdown(socket.SHUT_WR)
      while drained < _DRAIN_BYTES and (left_s := deadline - time.monotonic()) > 0:
        self.connection.settimeout(left_s)
        chunk = self.connection.recv(1 << 16)
        if not chunk:
          break
        drained += len(chunk)

  def _send_json(self, status: int, payload: Any) -> None:
    data = json.dumps(payload, ensure_ascii=self.ensure_ascii, default=str).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    if self.close_connection:
      self.send_header("Connection", "close")
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(data)

  def _send_stream(self, chunks: Iterator[bytes]) -> None:
    self.send_response(200)
    self.send_header("Content-Type", "text/event-stream")
    self.send_header("Cache-Control", "no-cache")
    self.send_header("Transfer-Encoding", "chunked")
    self.end_headers()
    try:
      for chunk in chunks:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
      self.wfile.write(b"0\r\n\r\n")
    except OSError:  # The client went away: closing the stream ends its request.
      self.close_connection = True
    finally:
      chunks.close()

  def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
    """Errors the base class detects (bad request lines, unknown methods) in the app's JSON too,
    always under a status line (a line it could not parse leaves the request taken for HTTP/0.9,
    whose answers have none)."""
    self.request_version = self.protocol_version
    self.close_connection = True
    text = message or self.responses.get(code, ("error",))[0]
    self._send_json(code, self.error_payload(code, text, "bad_request"))

  def log_message(self, format: str, *args: Any) -> None:
    logging.debug("%s: %s %s", self.server.name, self.address_string(), format % args)


class App:
  """What a served app shares: its `Server` (`self._http`), its address, and `with app:`, which
  serves from `start()` until `shutdown()` (both the app's)."""

  def __init__(self, address: tuple[str, int], handler: type[Handler], *, name: str,
               max_body_bytes: int):
    """Binds the socket; see `Server` for the arguments."""
    self._http = Server(address, handler, app=self, name=name, max_body_bytes=max_body_bytes)

  @property
  def port(self) -> int:
    return self._http.server_address[1]

  @property
  def url(self) -> str:
    return f"http://{self._http.server_address[0]}:{self.port}"

  def start(self) -> Self:
    """Serves in background threads until `shutdown()`."""
    raise NotImplementedError

  def shutdown(self) -> None:
    raise NotImplementedError

  def __enter__(self) -> Self:
    return self.start()

  def __exit__(self, *exc_info) -> None:
    self.shutdown()
