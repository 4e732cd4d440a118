"""What one sampler call costs beside its tokens: the fixed part of a decode call, and an append
to a few rows against one to every row, with the layers' weights kept out of their stack
between calls (`Sampler(keep_layout=True)`, the CPU default) or taken out in every call; and a
decode of a few of the rows on those rows alone (`Sampler(compact_decode=True)`, the default
without a mesh that splits the rows) or on every row.

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
The second table times decode N on 1, a quarter, half and all but one of the rows: the end of
a rollout, when rows have no episode left, and rows waiting for their env steps. The third
plays one round of replies of --reply_tokens at most, row i's ending after
(i + 1) / rows of them (a turn's replies end at different lengths): in one call, which runs
every row until the longest reply ends, or in calls that end once half their rows are done,
the others continuing in a call of their own (`Sampler.generate(shrink=True)`, what a rollout
does): the time, the calls and the idle row-steps (rows computed that sampled nothing).
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
import numpy as np

import agentgym_jax
from agentgym_jax import hardware
from agentgym_jax.models import decoder
from agentgym_jax.sampling import Sampler

_ROWS = flags.DEFINE_integer("rows", 8, "Rows of the sampler.")
_CONTEXT = flags.DEFINE_integer("context", 1000, "Tokens each row holds (a TextCraft turn 4-5).")
_TOKENS = flags.DEFINE_integer("tokens", 16, "Tokens of the longer decode call.")
_APPEND = flags.DEFINE_integer("append", 48, "Tokens of an appended observation.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per figure (the best is kept).")
_REPLY = flags.DEFINE_integer("reply_tokens", 64, "The longest reply of the third table.")


def best(call: Callable[[], object], reset: Callable[[], None]) -> float:
  """The best time of `call` over --repeats runs after a compiling one, `reset` untimed first."""
  times = []
  for _ in range(_REPEATS.value + 1):
    reset()
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return min(times[1:])


class Filled:
  """`sampler` with every row holding `prompt`, run with its params in the matmul `dtype`;
  `reset` restores that state before each timed call."""

  def __init__(self, sampler: Sampler, prompt: Sequence[int], dtype: object):
    self.sampler, self.context = sampler, len(prompt)
    self.params = decoder.matmul_copy(sampler.params, dtype)
    self.saved = jax.device_get(sampler.start([prompt] * sampler.max_batch, params=self.params))
    self.reset()

  def reset(self) -> None:
    self.state = jax.tree.map(jnp.asarray, self.saved)

  def decode(self, tokens: int, rows: Sequence[int] | None = None) -> object:
    """Samples `tokens` tokens on `rows` (default: every row)."""
    batch = self.sampler.max_batch
    return self.sampler.generate(self.state, jax.random.key(0), max_new_tokens=tokens, rows=rows,
                                 params=self.params, lengths=[self.context] * batch,
                                 budgets=[tokens] * batch)[1].tokens

  def append(self, rows: Sequence[int], tokens: Sequence[int]) -> object:
    return self.sampler.append(self.state, {row: tokens for row in rows}, params=self.params)

  def replies(self, budgets: np.ndarray, shrink: bool) -> tuple[int, int]:
    """Samples budgets[b] tokens on each row, in calls that end early with `shrink`, each
    continuing the replies not done; returns (calls, row-steps computed)."""
    sampled, calls, row_steps = np.zeros_like(budgets), 0, 0
    while (sampled < budgets).any():
      live = sampled < budgets
      self.state, out = self.sampler.generate(self.state, jax.random.key(0),
                                              max_new_tokens=int(budgets.max()),
                                              rows=np.flatnonzero(live).tolist(),
                                              params=self.params, lengths=self.context + sampled,
                                              budgets=budgets - sampled, offsets=sampled,
                                              shrink=shrink)
      lengths = np.asarray(out.lengths)
      calls += 1
      row_steps += len(self.sampler.decode_rows(live)) * int(lengths.max())
      sampled = sampled + lengths
    return calls, row_steps


def main(argv: Sequence[str]) -> None:
  del argv
  rows, context, tokens = _ROWS.value, _CONTEXT.value, _TOKENS.value
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
  print("| layout | decode 1 ms | decode N ms | a step ms | fixed part ms | append 1 row ms "
        "| append all rows ms |")
  print("|---|---|---|---|---|---|---|")
  for keep in (True, False):
    filled = Filled(
        Sampler(model, cache_slots=context + 2 * _APPEND.value + tokens, max_batch=rows,
                keep_layout=keep), prompt, dtype)
    one = best(lambda: filled.decode(1), filled.reset)
    many = best(lambda: filled.decode(tokens), filled.reset)
    step = (many - one) / (tokens - 1)
    one_row = best(lambda: filled.append([0], observation), filled.reset)
    all_rows = best(lambda: filled.append(range(rows), observation), filled.reset)
    print(f"| {'kept' if keep else 'per call'} | {1e3 * one:.0f} | {1e3 * many:.0f} | "
          f"{1e3 * step:.0f} | {1e3 * (one - step):.0f} | {1e3 * one_row:.0f} "
          f"| {1e3 * all_rows:.0f} |")
  print(f"\ndecode N: {tokens} tokens; appends of {_APPEND.value} tokens.\n")
  print("| rows decoding | on those rows ms | on every row ms | ratio |")
  print("|---|---|---|---|")
  counts = sorted({1, max(rows // 4, 1), max(rows // 2, 1), max(rows - 1, 1)})
  times = {}
  for compact in (True, False):
    filled = Filled(
        Sampler(model, cache_slots=context + tokens, max_batch=rows, compact_decode=compact),
        prompt, dtype)
    for count in counts:
      times[compact, count] = best(lambda: filled.decode(tokens, range(count)), filled.reset)
  for count in counts:
    compact, full = times[True, count], times[False, count]
    print(f"| {count} of {rows} | {1e3 * compact:.0f} | {1e3 * full:.0f} | {full / compact:.2f}x |")
  reply = _REPLY.value
  budgets = np.array([reply * (row + 1) // rows for row in range(rows)], np.int32)
  print(f"\nReplies of {budgets.tolist()} tokens:\n")
  print("| calls | ms | calls a round | idle row-steps |")
  print("|---|---|---|---|")
  filled = Filled(Sampler(model, cache_slots=context + reply, max_batch=rows), prompt, dtype)
  for shrink in (False, True):
    elapsed = best(lambda: filled.replies(budgets, shrink), filled.reset)
    calls, row_steps = filled.replies(budgets, shrink)
    filled.reset()
    print(f"| {'shrinking' if shrink else 'one'} | {1e3 * elapsed:.0f} | {calls} | "
          f"{1 - budgets.sum() / row_steps:.1%} |")
  print(f"\nLoad average at end {', '.join(f'{value:.1f}' for value in os.getloadavg())}.")


if __name__ == "__main__":
  app.run(main)
