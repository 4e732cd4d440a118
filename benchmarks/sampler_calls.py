"""What one sampler call costs beside its tokens: the fixed part of a decode call, and an append
to a few rows against one to every row, with the layers' weights kept out of their stack
between calls (`Sampler(keep_layout=True)`, the CPU default) or taken out in every call.

  python benchmarks/sampler_calls.py
  python benchmarks/sampler_calls.py --rows=16 --context=1500

Model: the embedded SmolLM2-135M-Instruct with its projections stored in the matmul dtype, as
the RL loop's sampler reads them (`decoder.matmul_copy`). --rows rows hold --context tokens
each. "decode 1" and "decode N" time calls that sample 1 and --tokens tokens on every row; the
fixed part of a call is decode 1 less one step, a step being (decode N - decode 1) / (N - 1).
"append 1 row" appends --append tokens (an observation) to one row, "append all rows" to every
row; a call on at most a quarter of the rows runs on a quarter of the batch
(`sampling._prefill_rows`). Every figure is the best of --repeats calls after a compiling one;
each call starts from the same state (restored, untimed). Chunked replies (rollout.decode_chunk)
pay the fixed part once a chunk and an append each time a row rejoins after its env step.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Sequence

from absl import app
from absl import flags

import jax
import jax.numpy as jnp

import agentgym_jax
from agentgym_jax import hardware
from agentgym_jax.models import decoder
from agentgym_jax.sampling import Sampler

_ROWS = flags.DEFINE_integer("rows", 8, "Rows of the sampler.")
_CONTEXT = flags.DEFINE_integer("context", 1000, "Tokens each row holds (a TextCraft turn 4-5).")
_TOKENS = flags.DEFINE_integer("tokens", 16, "Tokens of the longer decode call.")
_APPEND = flags.DEFINE_integer("append", 48, "Tokens of an appended observation.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per figure (the best is kept).")


def best(call: Callable[[], object], reset: Callable[[], None]) -> float:
  """The best time of `call` over --repeats runs after a compiling one, `reset` untimed first."""
  times = []
  for _ in range(_REPEATS.value + 1):
    reset()
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return min(times[1:])


def main(argv: Sequence[str]) -> None:
  del argv
  rows, context = _ROWS.value, _CONTEXT.value
  dtype = getattr(jnp, hardware.matmul_dtype("auto"))
  load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
  print(f"$ python {' '.join(sys.argv)}")
  print(hardware.describe())
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores), "
        f"load average at start {load}; {rows} rows of {context} tokens, matmuls in "
        f"{jnp.dtype(dtype).name}\n")
  model, _ = agentgym_jax.load_model("smollm2-135m-instruct", dtype=dtype)
  prompt = [(7 * i) % 4000 + 1 for i in range(context)]
  observation = list(range(5, 5 + _APPEND.value))
  every = list(range(rows))
  print("| layout | decode 1 ms | decode N ms | a step ms | fixed part ms | append 1 row ms "
        "| append all rows ms |")
  print("|---|---|---|---|---|---|---|")
  for keep in (True, False):
    sampler = Sampler(model, cache_slots=context + 2 * _APPEND.value + _TOKENS.value,
                      max_batch=rows, keep_layout=keep)
    params = decoder.matmul_copy(sampler.params, dtype)
    saved = jax.device_get(sampler.start([prompt] * rows, params=params))
    state = [saved]

    def reset() -> None:
      state[0] = jax.tree.map(jnp.asarray, saved)

    def decode(tokens: int) -> object:
      return sampler.generate(state[0], jax.random.key(0), max_new_tokens=tokens, params=params,
                              lengths=[context] * rows, budgets=[tokens] * rows)[1].tokens

    def append(appended: Sequence[int]) -> object:
      return sampler.append(state[0], {row: observation for row in appended}, params=params)

    one, many = best(lambda: decode(1), reset), best(lambda: decode(_TOKENS.value), reset)
    step = (many - one) / (_TOKENS.value - 1)
    print(
        f"| {'kept' if keep else 'per call'} | {1e3 * one:.0f} | {1e3 * many:.0f} | "
        f"{1e3 * step:.0f} | {1e3 * (one - step):.0f} | {1e3 * best(lambda: append([0]), reset):.0f} "
        f"| {1e3 * best(lambda: append(every), reset):.0f} |")
  print(f"\ndecode N: {_TOKENS.value} tokens; appends of {_APPEND.value} tokens. Load average at "
        f"end {', '.join(f'{value:.1f}' for value in os.getloadavg())}.")


if __name__ == "__main__":
  app.run(main)
