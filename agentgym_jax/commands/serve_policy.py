r"""agentgym-serve-policy: serves a policy behind OpenAI's chat completions API.

  agentgym-serve-policy                                       # SmolLM2-135M-Instruct on :8000
  agentgym-serve-policy --model=runs/local/export --port=8001 # a trained policy's HF export
  agentgym-serve-policy --model=qwen2.5-0.5b-instruct --max_batch=32 --max_context=8192

(From a checkout, `python launch/serve_policy.py` with the same flags.) --model is a registry
name (agentgym_jax.models.MODELS) or a Hugging Face checkpoint directory, loaded as
agentgym-generate loads it; clients name it by --served_model_name (default: --model's value).
Any OpenAI client then talks to it:

  client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")

Routes: GET /v1/models, POST /v1/chat/completions (streamed or not, tools, n, seed, stop),
GET /health. Concurrent requests are decoded together on one sampler of --max_batch rows of
--max_context tokens each; requests beyond the rows wait in a queue. docs/serving.md says what
the server supports. Stop with Ctrl-C or SIGTERM.
"""

import signal
import socket
import threading

from absl import app, flags

from agentgym_jax import cli
from agentgym_jax.serving import PolicyServer

_MODEL_FLAGS = cli.define_model_flags(__name__)
_SERVED_MODEL_NAME = flags.DEFINE_string(
    "served_model_name", None, "The model id clients send and /v1/models lists (default: "
    "--model's value).")
_HOST = flags.DEFINE_string("host", "127.0.0.1",
                            "Interface to listen on; 0.0.0.0 serves other machines too.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on (0 picks a free one).", lower_bound=0,
                             upper_bound=65535)
_MAX_BATCH = flags.DEFINE_integer("max_batch", 16, "Sampler rows: choices decoded at once.",
                                  lower_bound=1)
_MAX_CONTEXT = flags.DEFINE_integer("max_context", 4096,
                                    "Tokens a row holds: a request's prompt and reply.",
                                    lower_bound=2)
_CHUNK_TOKENS = flags.DEFINE_integer(
    "chunk_tokens", 16, "Tokens per decode call: what a stream sends at a time, and how often "
    "waiting requests may join the batch.", lower_bound=1)
_BATCH_WINDOW_MS = flags.DEFINE_float(
    "batch_window_ms", 0.0, "How long the first request to reach an idle server waits for "
    "others to start with it (until the rows are full).", lower_bound=0)
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 1024,
                                  "Choices that may wait for a row; beyond, requests get 429.",
                                  lower_bound=1)
_MAX_BODY_BYTES = flags.DEFINE_integer("max_body_bytes", 8 << 20,
                                       "Larger request bodies are refused with 413.", lower_bound=1)
_API_KEY = flags.DEFINE_string(
    "api_key", None, "If set, requests must carry `Authorization: Bearer <key>` (the openai "
    "client's api_key); else any key is accepted.")


def _check_address() -> None:
  """--host and --port can be listened on, before the model loads (the server binds them for
  good once it is built)."""
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # As the server binds.
      probe.bind((_HOST.value, _PORT.value))
  except OSError as error:  # The address is taken, or the host is not this machine's.
    raise app.UsageError(f"--host={_HOST.value} --port={_PORT.value}: "
                         f"{error.strerror or error}") from None


def _serve() -> None:
  _check_address()
  model, tokenizer, chat = _MODEL_FLAGS.load()
  name = _SERVED_MODEL_NAME.value or _MODEL_FLAGS.model.value
  try:
    server = PolicyServer(model, tokenizer, model_name=name, chat=chat, host=_HOST.value,
                          port=_PORT.value, max_batch=_MAX_BATCH.value,
                          max_context=_MAX_CONTEXT.value, cache_dtype=_MODEL_FLAGS.cache_dtype,
                          chunk_tokens=_CHUNK_TOKENS.value,
                          batch_window_s=_BATCH_WINDOW_MS.value / 1000, max_queue=_MAX_QUEUE.value,
                          max_body_bytes=_MAX_BODY_BYTES.value, api_key=_API_KEY.value)
  except OSError as error:  # Taken while the model loaded.
    raise app.UsageError(f"--host={_HOST.value} --port={_PORT.value}: {error.strerror or error}")
  stop = threading.Event()
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda *_: stop.set())
  server.start()
  print(
      f"Serving {name!r} at {server.url}/v1: {_MAX_BATCH.value} rows of {_MAX_CONTEXT.value} "
      f"tokens (KV cache {server.cache_bytes / 2**20:.0f} MiB)", flush=True)
  stop.wait()
  print("Shutting down", flush=True)
  server.shutdown()


def main() -> None:
  """agentgym-serve-policy."""
  cli.run(_serve)
