"""agentgym-serve-env: serves one environment over the AgentGym HTTP protocol.

  agentgym-serve-env --env=textcraft --port=36001
  agentgym-serve-env --env=textcraft --option=max_depth=2       # the adapter's keyword arguments
  agentgym-serve-env --env=textcraft --option=goals=agentgym    # the original's 544 goals

(From a checkout, `python launch/serve_env.py` with the same flags.) --option keys are checked
against the adapter's constructor, and one adapter is built and closed, at start-up: an option
the adapter refuses, or a missing extra, is one error line before the server listens.
Clients: `environments.make("http", base_url="http://127.0.0.1:36001", env="textcraft")` (in a
config, env.name=http and env.options.base_url, env.options.env; docs/env_servers.md), or the
original AgentGym clients.
Stop with Ctrl-C or SIGTERM; every hosted env is closed on the way out.
"""

import ast
import signal
import threading

from absl import app, flags

import environments
from agentgym_jax import cli
from agentgym_jax import settings as settings_lib
from environments.http import AgentGymServer

_ENV = flags.DEFINE_string("env", None, "Registered environment name, e.g. textcraft.",
                           required=True)
_HOST = flags.DEFINE_string("host", "127.0.0.1",
                            "Interface to listen on; 0.0.0.0 serves other machines too.")
_PORT = flags.DEFINE_integer("port", 36001, "Port to listen on (0 picks a free one).",
                             lower_bound=0, upper_bound=65535)
_MAX_ENVS = flags.DEFINE_integer("max_envs", 256, "Most envs hosted at once.", lower_bound=1)
_IDLE_TIMEOUT = flags.DEFINE_float("idle_timeout", 1800.0,
                                   "Seconds after which an untouched env is closed (0: never).",
                                   lower_bound=0)
_OPTIONS = flags.DEFINE_multi_string(
    "option", [], "An environment option key=value for environments.make (repeatable); the "
    "value is a Python literal (2, True, 'x') or else a string.")
_MAX_BODY_BYTES = flags.DEFINE_integer("max_body_bytes", 1 << 20,
                                       "Larger request bodies are refused with 413.", lower_bound=1)


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


def _serve() -> None:
  cli.check_env_name(_ENV.value)
  options = parse_options(_OPTIONS.value)
  try:
    problem = settings_lib.env_options_problem(_ENV.value, options, "--option=")
    if not problem:
      environments.make(_ENV.value, **options).close()
  except Exception as error:  # pylint: disable=broad-except
    reason = str(error).splitlines()[0] if str(error) else ""
    problem = (f"--env={_ENV.value} with options {options} cannot be built: "
               f"{type(error).__name__}: {reason}")
  if problem:
    raise app.UsageError(problem)
  try:
    server = AgentGymServer(_ENV.value, options=options, host=_HOST.value, port=_PORT.value,
                            max_envs=_MAX_ENVS.value, idle_timeout_s=_IDLE_TIMEOUT.value,
                            max_body_bytes=_MAX_BODY_BYTES.value)
  except OSError as error:  # The address is taken, or the host is not this machine's.
    raise app.UsageError(f"--host={_HOST.value} --port={_PORT.value}: {error.strerror or error}")
  stop = threading.Event()
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda *_: stop.set())
  server.start()
  print(f"Serving {server.env_name} ({server.style.name} payloads) at {server.url}", flush=True)
  stop.wait()
  print("Shutting down", flush=True)
  server.shutdown()


def main() -> None:
  """agentgym-serve-env."""
  cli.run(_serve)
