"""Sampler throughput: our jitted sampler against transformers `generate`, and multi-turn
continuation on the live KV cache against re-prefilling the conversation every turn.

  python benchmarks/sampling.py                          # batches 1, 8, 32, 64
  python benchmarks/sampling.py --quick                  # batches 1, 8, fewer tokens and turns
  python benchmarks/sampling.py --batches=32 --new_tokens=64 --skip_hf

Model: the embedded SmolLM2-135M-Instruct (weights dequantized from its GGUF file). Ours keeps
weights and KV cache in --param_dtype and multiplies in --dtype, accumulating in f32. On a CPU
without AMX or AVX512-BF16, XLA's bf16 x bf16 matmul is slower than its f32 one, so the default
multiplies in f32; bf16 storage halves the bytes each decode step streams but costs a
conversion per step (--param_dtype=float32 was ~25% faster at batch 32 on a 2-core AVX2 VM).
transformers loads the same weights, exported in f32 with `weights.save_hf`, in --hf_dtype.

Decode throughput. Every row gets a chat-rendered prompt (a system and a user turn, 30-60
tokens, ragged) and samples exactly --new_tokens tokens at temperature 1 (no stop ids, full
vocabulary) on both sides. "decode tok/s" is rows * tokens / the time after the prompt. Ours
times `Sampler.generate` after `Sampler.start` (each of its steps samples from the last hidden
state, then runs the forward pass on the new token). transformers is timed by a logits
processor that stamps each step: rows * (N - 1) tokens over the span from the prompt's logits
to the last token's. Every figure is the best of --repeats runs after a warm-up run (which
compiles ours). transformers runs with the torch thread count (1 or 2) that was faster on a
probe: torch's OpenMP threads spin on a loaded 2-core machine.

FLOP/s. A decode token costs 2 * (matmul weights, with the tied LM head) + 4 * layers *
heads * head_dim * (mean cached context) FLOPs; "of peak" divides the achieved rate by the
best rate of a bf16 x bf16 -> f32 `jnp.dot` on --peak_size square matrices measured here (and of
the f32 one, for reference).

Roofline. A decode step cannot take less than the larger of the time to read its bytes (every
matmul weight in --param_dtype and each row's cached keys and values in the cache dtype, at the
read bandwidth of a jitted sum over a --bandwidth_mb array) and the time of its FLOPs at the
--dtype matmul peak; "of roofline" is that bound over the measured step time. "dense matmuls
alone" is the same bound over the time of only the step's projection and LM-head matmuls at
that batch (`jnp.dot` on the model's weight shapes, chained layer by layer): the most of the
roofline any decode step built on XLA's dot reaches at that batch. "draw alone" times the
step's sampling (`sample_tokens` at temperature 1 on [batch, vocabulary] logits).

Windows. A decode step's cost must follow the bytes it reads, not the size of the cache or of
the window the longest row needs: at batch --window_batch, the step is timed with one row's
context ending at each of --windows (256 and 2048) and the other rows holding a chat prompt's
worth (--window_others tokens), so the longer window adds only that one row's extra slots; the
ratio of the two steps is a target (<= 1.3x). For reference the same is timed with every row at
the window, where the bytes themselves grow (the table prints the roofline's own ratio). These
states are made directly (lengths set on an empty cache of --windows' largest size, which the
step never reads past the rows' ends): a step's time does not depend on the cached values.

Multi-turn. --conversations rows hold a conversation of --turns turns: the assistant samples
--turn_tokens tokens, then an observation of 10-40 tokens per row is appended as the next user
turn plus the assistant header (`ChatTemplate.continuation_ids`). "live cache" appends to the
state and keeps decoding; "re-prefill" starts a fresh state from the whole conversation every
turn, as a sampler without continuation must. Both sample the same tokens from the same keys
(the tokens-equal column checks it; bf16 prefill and decode may round differently). The
conversations open with the chat prompts above (--conversation_prompt=chat) or with TextCraft's
first prompts (=textcraft: the instruction and a task's goal, 600-700 tokens, as a rollout
starts). Both sides decode the same tokens, so the table splits each side into its decode and
the rest (prefills and appends): the live cache removes only the rest.

Other work on the machine skews every figure: the header prints the load average.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Callable, Sequence

from absl import app
from absl import flags

import jax
import jax.numpy as jnp
import numpy as np

import agentgym_jax
import environments
from agentgym_jax import hardware
from agentgym_jax.models import weights
from agentgym_jax.sampling import Sampler, SamplingParams, bucket, sample_tokens

_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32", "64"], "Batch sizes to measure.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 32, "Tokens sampled per row (--quick: 16).")
_DTYPE = flags.DEFINE_enum(
    "dtype", "auto", ["auto", "bfloat16", "float32"],
    "Our matmul input dtype (matmuls accumulate in f32; auto: bf16 where "
    "the hardware runs it fast).")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", "bfloat16", ["bfloat16", "float32"],
                                 "Our weight and KV cache storage dtype.")
_HF_DTYPE = flags.DEFINE_enum("hf_dtype", "float32", ["bfloat16", "float32"],
                              "transformers' weights and compute.")
_SKIP_HF = flags.DEFINE_bool("skip_hf", False, "Measure only our sampler.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed runs per figure (the best is kept).")
_TURNS = flags.DEFINE_integer("turns", 8, "Turns of the multi-turn conversation (--quick: 4).")
_TURN_TOKENS = flags.DEFINE_integer("turn_tokens", 32, "Tokens sampled per assistant turn.")
_CONVERSATIONS = flags.DEFINE_integer("conversations", 8, "Rows of the multi-turn benchmark.")
_CONVERSATION_PROMPT = flags.DEFINE_enum(
    "conversation_prompt", "chat", ["chat", "textcraft"],
    "How the multi-turn conversations open: a short chat prompt, or TextCraft's first prompt.")
_PEAK_SIZE = flags.DEFINE_integer("peak_size", 2048, "Side of the matmul measuring the peak.")
_BANDWIDTH_MB = flags.DEFINE_integer("bandwidth_mb", 1024,
                                     "Size of the array whose sum measures read bandwidth.")
_WINDOWS = flags.DEFINE_list("windows", ["256", "2048"],
                             "Windows (longest row's context) of the decode-step timing.")
_WINDOW_BATCH = flags.DEFINE_integer("window_batch", 8, "Rows of the decode-step timing.")
_WINDOW_OTHERS = flags.DEFINE_integer("window_others", 64,
                                      "Context of the rows other than the longest one.")
_QUICK = flags.DEFINE_bool("quick", False, "A smoke run: batches 1 and 8, fewer tokens/turns.")

_USER_MESSAGES = ("Craft a wooden pickaxe. You have 3 oak logs.",
                  "What is the capital of France, and why is it famous?",
                  "Write a haiku about reinforcement learning agents exploring a grid world.",
                  "List three uses of redstone in Minecraft and explain each in one sentence.",
                  "You are in a room with a red door and a blue key. What do you do first?",
                  "Summarize the rules of chess in two sentences.",
                  "Translate 'the agent picks up the key' into French and Spanish.",
                  "Explain why the sky is blue to a five year old.")


def _best(run: Callable[[], object], repeats: int) -> float:
  """The best wall time of `repeats` calls of run (which blocks until its result is ready)."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return min(times)


def _peak_flops(size: int, dtype, repeats: int = 3) -> float:
  """FLOP/s of a `dtype` square matmul accumulating in f32, the best of `repeats` runs."""
  a = jnp.ones((size, size), dtype)
  b = jnp.ones((size, size), dtype)
  matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  matmul(a, b).block_until_ready()
  return 2 * size**3 / _best(lambda: matmul(a, b).block_until_ready(), repeats)


def _read_bandwidth(megabytes: int, repeats: int = 3) -> float:
  """Bytes/s of a jitted f32 sum over a `megabytes` array, the best of `repeats` runs."""
  a = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(a).block_until_ready()
  return a.nbytes / _best(lambda: total(a).block_until_ready(), repeats)


def _matmul_weights(config) -> int:
  """Parameters a decode token multiplies by: all but the norms (the tied embedding is the LM
  head)."""
  return config.num_params - config.hidden_size * (1 + 2 * config.num_layers)


def _decode_step_bytes(config, batch: int, context: float, param_bytes: int,
                       cache_bytes: int) -> float:
  """Bytes one decode step must read: every matmul weight and each row's cached keys/values."""
  cache = 2 * config.num_layers * config.num_kv_heads * config.head_dim * context * batch
  return _matmul_weights(config) * param_bytes + cache * cache_bytes


def _decode_flops_per_token(config, context: float) -> float:
  """Matmul FLOPs of one decode token at a mean cached context of `context` tokens."""
  matmul_weights = _matmul_weights(config)
  attention = 4 * config.num_layers * config.num_heads * config.head_dim * context
  return 2 * matmul_weights + attention


def _dense_matmuls(config, dtype, param_dtype) -> Callable[[int], float]:
  """A timer of one decode step's dense matmuls alone: batch -> seconds. The step runs every
  layer's q, k, v, o, gate, up and down projections chained as in the model, then the LM head (no
  attention, norms or sampling). Each layer has weights of its own (made once, here), so every
  step streams them all.
  """
  e, v = config.hidden_size, config.vocab_size
  heads, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  f = config.intermediate_size
  shapes = ((e, heads), (e, kv), (e, kv), (heads, e), (e, f), (e, f), (f, e))
  key = jax.random.key(0)
  layers = [[
      (0.02 * jax.random.normal(jax.random.fold_in(key, 7 * layer + i), shape)).astype(param_dtype)
      for i, shape in enumerate(shapes)
  ] for layer in range(config.num_layers)]
  head = (0.02 * jax.random.normal(key, (e, v))).astype(param_dtype)
  dot = lambda x, w: jnp.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)

  @jax.jit
  def step(x, layers, head):
    kv_sum = 0.0
    for wq, wk, wv, wo, wg, wu, wd in layers:
      kv_sum += dot(x, wk).sum() + dot(x, wv).sum()
      x = x + dot(dot(x, wq), wo)
      x = x + dot(jax.nn.silu(dot(x, wg)) * dot(x, wu), wd)
    return dot(x, head).sum() + kv_sum

  def seconds(batch: int, repeats: int = 3) -> float:
    x = jax.random.normal(key, (batch, e))
    step(x, layers, head).block_until_ready()
    return _best(lambda: step(x, layers, head).block_until_ready(), repeats)

  return seconds


def _draw_seconds(config, batch: int, repeats: int = 3) -> float:
  """The time of a decode step's draw alone: `sample_tokens` at temperature 1 over the full
  vocabulary on [batch, vocab] logits (random bits, the race, both log-probs)."""
  keys = jax.random.split(jax.random.key(0), batch)
  logits = jax.random.normal(jax.random.key(1), (batch, config.vocab_size))
  draw = jax.jit(lambda keys, logits: sample_tokens(keys, logits, SamplingParams()))
  jax.block_until_ready(draw(keys, logits))
  return _best(lambda: jax.block_until_ready(draw(keys, logits)), repeats)


def _prompts(chat, batch: int) -> list[list[int]]:
  return [
      chat.render([{"role": "user", "content": _USER_MESSAGES[row % len(_USER_MESSAGES)]}])
      for row in range(batch)
  ]


def _ours(model, prompts: list[list[int]], new_tokens: int, repeats: int,
          cache_dtype) -> dict[str, float]:
  batch = len(prompts)
  slots = bucket(max(map(len, prompts)) + new_tokens, 128)
  sampler = Sampler(model, cache_slots=slots, max_batch=batch, cache_dtype=cache_dtype)
  timings = {"prefill": [], "decode": []}
  for run in range(repeats + 1):  # The first run compiles.
    start = time.perf_counter()
    state = jax.block_until_ready(sampler.start(prompts))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    state, out = sampler.generate(state, jax.random.key(run), max_new_tokens=new_tokens)
    jax.block_until_ready(out)
    decode = time.perf_counter() - start
    if run:
      timings["prefill"].append(prefill)
      timings["decode"].append(decode)
    assert int(out.lengths.min()) == new_tokens
  prefill, decode = min(timings["prefill"]), min(timings["decode"])
  return {
      "prefill_s": prefill, "decode_s": decode, "decode_tps": batch * new_tokens / decode,
      "total_tps": batch * new_tokens / (prefill + decode)
  }


def _window_steps(model, batch: int, windows: Sequence[int], others: int, repeats: int, cache_dtype,
                  steps: int = 16) -> dict[tuple[str, int], float]:
  """Seconds of one decode step at batch `batch`, keyed by (case, window): case "one" has row
  0's context ending at the window and the others at `others` tokens, "every" every row at it.
  """
  sampler = Sampler(model, cache_slots=max(windows), max_batch=batch, cache_dtype=cache_dtype)
  seconds = {}
  for case in ("one", "every"):
    for window in windows:
      lengths = np.full(batch, window - steps if case == "every" else others, np.int32)
      lengths[0] = window - steps

      def run():
        state = sampler.empty()  # Fresh buffers: each call donates the state it is given.
        state = state.replace(
            cache=state.cache.replace(lengths=jnp.asarray(lengths)),
            hidden=jax.random.normal(jax.random.key(window), (batch, model.config.hidden_size)))
        jax.block_until_ready(state)
        start = time.perf_counter()
        _, out = sampler.generate(state, jax.random.key(0), max_new_tokens=steps, lengths=lengths)
        jax.block_until_ready(out)
        return time.perf_counter() - start

      run()  # Compiles (once: a decode step has no window).
      seconds[case, window] = min(run() for _ in range(repeats)) / steps
  return seconds


class _HuggingFace:
  """transformers' generate on the same weights, with left-padded prompts."""

  def __init__(self, model, dtype: str):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    self.torch = torch
    directory = tempfile.mkdtemp(prefix="smollm2_hf_")
    weights.save_hf(model, directory, dtype=jnp.float32)
    self.model = transformers.AutoModelForCausalLM.from_pretrained(directory,
                                                                   dtype=getattr(torch,
                                                                                 dtype)).eval()
    self.threads = torch.get_num_threads()
    self.stamps: list[float] = []

  def _stamp(self, input_ids, scores):
    """A logits processor that only records when each token's logits are ready."""
    del input_ids
    self.stamps.append(time.perf_counter())
    return scores

  def pick_threads(self, prompts: list[list[int]]) -> None:
    """Keeps the torch thread count (1 or 2) that decodes a probe faster."""
    timings = {}
    for threads in (1, 2):
      self.torch.set_num_threads(threads)
      self.generate(prompts, 2)
      timings[threads] = _best(lambda: self.generate(prompts, 4), 1)
    self.threads = min(timings, key=timings.get)
    self.torch.set_num_threads(self.threads)

  def generate(self, prompts: list[list[int]], new_tokens: int):
    torch = self.torch
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
      ids[row, width - len(prompt):] = torch.tensor(prompt)
      mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
      out = self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                top_p=1.0, pad_token_id=0, logits_processor=[self._stamp])
    assert out.shape[1] == width + new_tokens
    return out

  def measure(self, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict[str, float]:
    self.generate(prompts, 2)
    decode, total = [], []
    for _ in range(repeats):
      self.stamps = []
      start = time.perf_counter()
      self.generate(prompts, new_tokens)
      total.append(time.perf_counter() - start)
      # Stamp t follows the forward pass of token t; token 0's is the prompt's.
      decode.append(self.stamps[-1] - self.stamps[0])
    return {
        "decode_tps": len(prompts) * (new_tokens - 1) / min(decode),
        "total_tps": len(prompts) * new_tokens / min(total)
    }


def _textcraft_prompts(chat, rows: int) -> list[list[int]]:
  """The first prompts of `rows` TextCraft training tasks, rendered as a rollout renders them."""
  env = environments.make("textcraft")
  try:
    return [
        chat.render([{"role": "user", "content": f"{env.instruction}\n\n{env.reset(task_id)}"}])
        for task_id in list(env.task_ids("train"))[:rows]
    ]
  finally:
    env.close()


def _conversation(model, chat, prompts: list[list[int]], turns: int, turn_tokens: int,
                  cache_dtype) -> dict[str, float]:
  """Seconds for `turns` turns on the live cache and by re-prefilling every turn, and of each
  the seconds spent in `Sampler.generate`."""
  rows = len(prompts)
  rng = np.random.RandomState(0)
  observations = [[
      chat.continuation_ids(
          "user",
          f"Observation {turn}: " + " ".join(["the agent sees a door"] * int(rng.randint(1, 7))))
      for _ in range(rows)
  ] for turn in range(turns)]
  length = max(map(len, prompts)) + sum(turn_tokens + max(map(len, o)) for o in observations)
  sampler = Sampler(model, cache_slots=bucket(length, 128), max_batch=rows, cache_dtype=cache_dtype)

  decode_s = {}

  def generate(side, state, turn):
    jax.block_until_ready(state)  # The prefill or append before is not timed as decode.
    start = time.perf_counter()
    state, out = sampler.generate(state, jax.random.key(turn), max_new_tokens=turn_tokens)
    tokens = out.token_lists()
    decode_s[side] = decode_s.get(side, 0.0) + time.perf_counter() - start
    return state, tokens

  def live() -> list[list[int]]:
    state = sampler.start(prompts)
    generated = [[] for _ in range(rows)]
    for turn in range(turns):
      state, out = generate("live", state, turn)
      for row, tokens in enumerate(out):
        generated[row] += tokens
      if turn + 1 < turns:
        state = sampler.append(state, dict(enumerate(observations[turn])))
    return generated

  def reprefill() -> list[list[int]]:
    conversations = [list(prompt) for prompt in prompts]
    generated = [[] for _ in range(rows)]
    for turn in range(turns):
      state, out = generate("reprefill", sampler.start(conversations), turn)
      for row, tokens in enumerate(out):
        generated[row] += tokens
        conversations[row] += tokens + (observations[turn][row] if turn + 1 < turns else [])
    return generated

  live_tokens, reprefill_tokens = live(), reprefill()  # Warm-up: compiles every bucket.
  decode_s.clear()
  live_s = _best(live, 1)
  reprefill_s = _best(reprefill, 1)
  same = np.mean([a == b for x, y in zip(live_tokens, reprefill_tokens) for a, b in zip(x, y)])
  return {
      "live_s": live_s, "reprefill_s": reprefill_s, "live_decode_s": decode_s["live"],
      "reprefill_decode_s": decode_s["reprefill"], "tokens_equal": float(same), "context": length,
      "prompt": float(np.mean([len(p) for p in prompts]))
  }


def main(argv: Sequence[str]) -> None:
  del argv
  quick = _QUICK.value
  default_batches = quick and _BATCHES.value == _BATCHES.default
  batches = [1, 8] if default_batches else [int(b) for b in _BATCHES.value]
  new_tokens = 16 if quick and _NEW_TOKENS.value == _NEW_TOKENS.default else _NEW_TOKENS.value
  turns = 4 if quick and _TURNS.value == _TURNS.default else _TURNS.value
  dtype_name = hardware.matmul_dtype(_DTYPE.value)
  dtype, param_dtype = getattr(jnp, dtype_name), getattr(jnp, _PARAM_DTYPE.value)
  load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
  print(f"$ python {' '.join(sys.argv)}")
  print(hardware.describe())
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores), "
        f"load average at start {load}")

  model, tokenizer = agentgym_jax.load_model("smollm2-135m-instruct", dtype=dtype,
                                             param_dtype=param_dtype)
  chat = tokenizer.chat
  config = model.config
  peak = _peak_flops(_PEAK_SIZE.value, jnp.bfloat16)
  f32_peak = _peak_flops(_PEAK_SIZE.value, jnp.float32)
  bandwidth = _read_bandwidth(_BANDWIDTH_MB.value)
  print(f"matmul peaks ({_PEAK_SIZE.value}^2, f32 accumulation): bf16 {peak / 1e9:.1f}, "
        f"f32 {f32_peak / 1e9:.1f} GFLOP/s; read bandwidth {bandwidth / 1e9:.1f} GB/s")
  matmul_peak = peak if dtype_name == "bfloat16" else f32_peak
  item_bytes = jnp.dtype(param_dtype).itemsize

  hf = None
  if not _SKIP_HF.value:
    import torch  # pylint: disable=g-import-not-at-top
    float_model, _ = agentgym_jax.load_model("smollm2-135m-instruct")
    hf = _HuggingFace(float_model, _HF_DTYPE.value)
    hf.pick_threads(_prompts(chat, 8))
    print(f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
          f"{hf.threads} thread(s), {_HF_DTYPE.value}")

  dense_matmuls = _dense_matmuls(config, dtype, param_dtype)
  rows = []
  for batch in batches:
    prompts = _prompts(chat, batch)
    ours = _ours(model, prompts, new_tokens, _REPEATS.value, param_dtype)
    context = np.mean([len(p) for p in prompts]) + new_tokens / 2
    token_flops = _decode_flops_per_token(config, context)
    flops = ours["decode_tps"] * token_flops
    step_bytes = _decode_step_bytes(config, batch, context, item_bytes, item_bytes)
    bound = max(step_bytes / bandwidth, batch * token_flops / matmul_peak)
    roofline = bound / (batch / ours["decode_tps"])
    matmul_roofline = bound / dense_matmuls(batch)
    draw_ms = 1e3 * _draw_seconds(config, batch)
    theirs = hf.measure(prompts, new_tokens, _REPEATS.value) if hf else None
    rows.append((batch, ours, theirs, flops, roofline, matmul_roofline, draw_ms))
    ratio = f"{ours['decode_tps'] / theirs['decode_tps']:.1f}x" if theirs else "-"
    print(
        f"  batch {batch}: ours {ours['decode_tps']:.1f} tok/s, "
        f"transformers {theirs['decode_tps'] if theirs else float('nan'):.1f} tok/s, "
        f"{ratio}", flush=True)

  windows = [int(w) for w in _WINDOWS.value]
  window_batch = _WINDOW_BATCH.value
  window_steps = _window_steps(model, window_batch, windows, _WINDOW_OTHERS.value,
                               _REPEATS.value + 1, param_dtype)
  conversation_prompts = (_textcraft_prompts if _CONVERSATION_PROMPT.value == "textcraft" else
                          _prompts)(chat, _CONVERSATIONS.value)
  conversation = _conversation(model, chat, conversation_prompts, turns, _TURN_TOKENS.value,
                               param_dtype)

  print()
  print(f"Decode, SmolLM2-135M-Instruct, {new_tokens} new tokens per row at temperature 1; "
        f"ours {dtype_name} matmuls on {_PARAM_DTYPE.value} weights and cache, "
        f"transformers {_HF_DTYPE.value} "
        f"({hf.threads if hf else '-'} torch thread(s)); load average {load}.")
  print()
  print("| batch | ours decode tok/s | transformers decode tok/s | ratio | ours prefill s "
        "| ours end-to-end tok/s | transformers end-to-end tok/s | ours GFLOP/s | of bf16 peak "
        "| of f32 peak | of roofline | dense matmuls alone, of roofline | step ms "
        "| draw alone ms |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for batch, ours, theirs, flops, roofline, matmul_roofline, draw_ms in rows:
    hf_decode = f"{theirs['decode_tps']:.1f}" if theirs else "-"
    hf_total = f"{theirs['total_tps']:.1f}" if theirs else "-"
    ratio = f"{ours['decode_tps'] / theirs['decode_tps']:.1f}x" if theirs else "-"
    print(f"| {batch} | {ours['decode_tps']:.1f} | {hf_decode} | {ratio} | "
          f"{ours['prefill_s']:.2f} | {ours['total_tps']:.1f} | {hf_total} | "
          f"{flops / 1e9:.1f} | {flops / peak:.0%} | {flops / f32_peak:.0%} | {roofline:.0%} | "
          f"{matmul_roofline:.0%} | {1e3 * batch / ours['decode_tps']:.0f} | {draw_ms:.0f} |")
  print()
  print(f"Decode step at batch {window_batch} by window (the longest row's context); roofline "
        f"ratio: the bytes the longer window's step must read over the shorter's:")
  print()
  print("| rows at the window | " + " | ".join(f"step ms at {w}" for w in windows) +
        f" | ratio {windows[-1]}/{windows[0]} | roofline ratio |")
  print("|---|" + "---:|" * (len(windows) + 2))
  for case, label in (("one", f"one (the others at {_WINDOW_OTHERS.value})"), ("every", "every")):
    # Bytes of the step: the weights and every row's cache (batch 1 over the summed contexts).
    step_bytes = [
        _decode_step_bytes(
            config, 1, w + (window_batch - 1) * (w if case == "every" else _WINDOW_OTHERS.value),
            item_bytes, item_bytes) for w in (windows[0], windows[-1])
    ]
    print(f"| {label} | " + " | ".join(f"{1e3 * window_steps[case, w]:.1f}" for w in windows) +
          f" | {window_steps[case, windows[-1]] / window_steps[case, windows[0]]:.2f}x | "
          f"{step_bytes[1] / step_bytes[0]:.2f}x |")
  print()
  print(f"Multi-turn, {_CONVERSATIONS.value} conversations x {turns} turns of "
        f"{_TURN_TOKENS.value} sampled tokens + a 10-40 token observation, opening with "
        f"{_CONVERSATION_PROMPT.value} prompts of {conversation['prompt']:.0f} tokens on average "
        f"(up to {conversation['context']} tokens of context); each side's seconds, then its "
        "decode (`Sampler.generate`) and the rest (prefills, appends):")
  print()
  print("| live cache s | re-prefill s | speed-up | live decode + rest s "
        "| re-prefill decode + rest s | speed-up of the rest | tokens equal |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  rest = {
      side: conversation[f"{side}_s"] - conversation[f"{side}_decode_s"]
      for side in ("live", "reprefill")
  }
  print(f"| {conversation['live_s']:.1f} | {conversation['reprefill_s']:.1f} | "
        f"{conversation['reprefill_s'] / conversation['live_s']:.1f}x | "
        f"{conversation['live_decode_s']:.1f} + {rest['live']:.1f} | "
        f"{conversation['reprefill_decode_s']:.1f} + {rest['reprefill']:.1f} | "
        f"{rest['reprefill'] / rest['live']:.1f}x | {conversation['tokens_equal']:.0%} |")
  rooflines = {batch: roofline for batch, _, _, _, roofline, _, _ in rows}
  print("\nTargets: of roofline " +
        (", ".join(f"batch {b} {rooflines[b]:.0%}" for b in (32, 64) if b in rooflines) or "-") +
        " (>= 40%, goal 60%); decode step at window "
        f"{windows[-1]} over {windows[0]}, batch {window_batch}, one row at the window "
        f"{window_steps['one', windows[-1]] / window_steps['one', windows[0]]:.2f}x (<= 1.3x); "
        f"live cache over re-prefill at {turns} turns "
        f"{conversation['reprefill_s'] / conversation['live_s']:.1f}x (>= 3x).")
  print(f"\nmatmul peaks: bf16 {peak / 1e9:.1f}, f32 {f32_peak / 1e9:.1f} GFLOP/s; read "
        f"bandwidth {bandwidth / 1e9:.1f} GB/s; load average at end "
        f"{', '.join(f'{value:.1f}' for value in os.getloadavg())}")


if __name__ == "__main__":
  app.run(main)
