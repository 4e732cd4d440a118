"""Serves one environment over the AgentGym HTTP protocol.

  python launch/serve_env.py --env=textcraft --port=36001
  python launch/serve_env.py --env=textcraft --option=max_depth=2   # environments.make options
  python launch/serve_env.py --env=textcraft --option=goals=agentgym   # the original's 544 goals

Clients: `environments.make("http", base_url="http://127.0.0.1:36001", env="textcraft")`, or the
original AgentGym clients. Stop with Ctrl-C or SIGTERM; every hosted env is closed on the way out.
"""

import ast
import signal
import threading

from absl import app
from absl import flags
from absl import logging

from environments.http import AgentGymServer

_ENV = flags.DEFINE_string("env", None, "Registered environment name, e.g. textcraft.",
                           required=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1",
                            "Interface to listen on; 0.0.0.0 serves other machines too.")
_PORT = flags.DEFINE_integer("port", 36001, "Port to listen on (0 picks a free one).")
_MAX_ENVS = flags.DEFINE_integer("max_envs", 256, "Most envs hosted at once.")
_IDLE_TIMEOUT = flags.DEFINE_float("idle_timeout", 1800.0,
                                   "Seconds after which an untouched env is closed (0: never).")
_OPTIONS = flags.DEFINE_multi_string(
    "option", [], "An environment option key=value for environments.make (repeatable); the "
    "value is a Python literal (2, True, 'x') or else a string.")
_MAX_BODY_BYTES = flags.DEFINE_integer("max_body_bytes", 1 << 20,
                                       "Larger request bodies are refused with 413.")


def parse_options(options: list[str]) -> dict[str, object]:
  """{"max_depth": 2} from ["max_depth=2"]; a value that is no Python literal stays a string."""
  parsed = {}
  for option in options:
    key, sep, text = option.partition("=")
    if not sep or not key.isidentifier():
      raise app.UsageError(f"--option must be key=value, got {option!r}")
    try:
      parsed[key] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      parsed[key] = text
  return parsed


def main(argv: list[str]) -> None:
  del argv
  server = AgentGymServer(_ENV.value, options=parse_options(_OPTIONS.value), host=_HOST.value,
                          port=_PORT.value, max_envs=_MAX_ENVS.value,
                          idle_timeout_s=_IDLE_TIMEOUT.value, max_body_bytes=_MAX_BODY_BYTES.value)
  stop = threading.Event()
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda *_: stop.set())
  server.start()
  logging.info("Serving %s (%s payloads) at %s", server.env_name, server.style.name, server.url)
  stop.wait()
  logging.info("Shutting down")
  server.shutdown()


if __name__ == "__main__":
  app.run(main)
