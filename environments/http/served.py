"""launch/serve_env.py in a subprocess on a free loopback port, for benchmarks and tests.

  with serve_in_subprocess("textcraft", max_envs=32) as served:
    client = AgentGymClient(served.url, "textcraft")     # and served.port, served.pid

It needs a source checkout (launch/ is not installed). The server's log goes to a temporary
file rather than a pipe nobody reads, which would block the server once full; a server that
exits or does not answer in time raises RuntimeError with the log's end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator

REPO = pathlib.Path(__file__).resolve().parents[2]
SERVE_ENV = REPO / "launch" / "serve_env.py"


@dataclasses.dataclass(frozen=True)
class Served:
  port: int
  pid: int  # the server's process

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
  """A loopback port that was free a moment ago."""
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


@contextlib.contextmanager
def serve_in_subprocess(env: str, *, start_timeout_s: float = 120.0,
                        **flags: object) -> Iterator[Served]:
  """Serves `env` until the block ends, then stops the server with SIGTERM (or SIGKILL).

  `flags` are serve_env.py's flags (max_envs=32, idle_timeout=0, ...). Yields once the server
  answers GET /.
  """
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  command = [sys.executable, str(SERVE_ENV), f"--env={env}", f"--port={port}"
            ] + [f"--{name}={value}" for name, value in flags.items()]
  python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
  with tempfile.TemporaryFile() as log:
    server = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": python_path},
                              stdout=subprocess.DEVNULL, stderr=log)

    def failure(what: str) -> RuntimeError:
      log.seek(0)
      return RuntimeError(f"{' '.join(command)} {what}:\n"
                          f"{log.read()[-4000:].decode(errors='replace')}")

    try:
      deadline = time.monotonic() + start_timeout_s
      while True:
        if server.poll() is not None:
          raise failure(f"exited with code {server.returncode}")
        try:
          with urllib.request.urlopen(url + "/", timeout=1.0):
            break
        except OSError:
          if time.monotonic() > deadline:
            raise failure(f"did not answer within {start_timeout_s} s") from None
          time.sleep(0.05)
      yield Served(port, server.pid)
    finally:
      server.terminate()  # serve_env.py closes every hosted env on SIGTERM.
      try:
        server.wait(timeout=30)
      except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
