"""The jitted sampler: prefill, decode and multi-turn continuation on a static, donated KV cache.

    sampler = Sampler(model, cache_slots=4096, max_batch=64)
    state = sampler.start(prompts)                        # list[list[int]], one per row
    state, out = sampler.generate(state, key, max_new_tokens=512, stop_ids=chat.turn_end_ids,
                                  sampling=SamplingParams(temperature=1.0))
    state = sampler.append(state, {0: observation_ids})   # row -> ids of the next user turn
    state, out = sampler.generate(state, key2, rows=[0], max_new_tokens=512, ...)

Everything stays token-in/token-out: `append` takes ids, never text.

State. A `SamplerState` is the live KV cache (`KVCache`: row b holds `lengths[b]` valid slots)
and, per row, the final hidden state of its last cached token, from which the next token's
logits follow. Every token a row has seen or produced is in the cache, including the token that
ended a turn: the decode step that samples token t also runs the forward pass on t. So
`append` is the prefill of the new tokens at each row's end and `start` is `append` on an empty
cache; no turn is ever prefilled twice. Each call donates the state it is given (its buffers are
reused in place), so always continue from the returned state.

Parameters are an argument of every compiled function (`nnx.split(model)` graphdef / state):
pass `params=` to run with updated policy weights without recompiling; by default the weights
the sampler was built with are used. A state is only meaningful under the params that built it.

Rows. `max_batch` rows are compiled once. `generate(rows=...)` decodes only the listed rows (by
default every row holding tokens); other rows append nothing and their results are padding.
With `compact_decode` (the default when no mesh splits the rows) a decode of few rows computes
on them alone, padded with idle rows to a bucket of rows (`decode_rows`): the last episodes of
a rollout, or rows whose env steps are out, do not pay for the whole batch.
A row's tokens and log-probs depend only on its own tokens and its own key: per-row keys are
`fold_in(key, row)` (or given explicitly, one per row), and the t-th token of a call draws from
`fold_in(row_key, t)`.

Outputs (`SampleOutput`, [batch, max_new_tokens]): the tokens; `logprobs`, log p(token) under the
model's full distribution at temperature 1, which is what the trainer recomputes; and
`sampling_logprobs`, log q(token) under the distribution actually sampled from (temperature,
top-k, top-p applied; 0 for greedy, a point mass). A row stops after a stop id (kept as its last
token), after `max_new_tokens`, or when its cache is full.

Compilation. Shapes are bucketed so a rollout compiles a handful of programs: appended and
prompt lengths are rounded up by `bucket` (the next 2^k or 3 * 2^(k-1), at least `min_bucket`),
`max_new_tokens` likewise, and a prefill's attention window (the cache prefix it reads, which
must cover every row's end) to a bucket of at least `min_window`, capped at `cache_slots`; an
append to at most a quarter of the rows runs on a quarter of the batch (`_prefill_rows`, one more
program per length and window bucket, 4x less work for a row rejoining the decode). A decode
step has no window: each row reads only the slots it holds (`attention.decode_attention`), so
its cost follows the rows' lengths and one program serves every length (one per bucket of
rows with `compact_decode`, at most two an octave, each compiled the first time a call needs
it). The sampling settings (temperature, top_p, top_k) are compile-time constants. Stop ids
are padded to `MAX_STOP_IDS`.

Decode loop. The per-layer weights are taken out of their stack (`Decoder.cached_layers`) once
per `generate` call, or, with `keep_layout` (the default on CPU), once per params and kept for
the calls after; each layer's cache is its own donated buffer, updated in place: a step copies
neither (tests/test_sampling_hlo.py reads the compiled program).

Sharding. With a mesh, rows are split over (data, fsdp) and the cache's kv heads over tensor, by
the logical axes in `agentgym_jax.sharding` (the cache's are `KVCache.AXES`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh

from agentgym_jax import sharding
from agentgym_jax.models.decoder import Cached, DecodeLayer, Decoder, KVCache

Array = jax.Array
MAX_STOP_IDS = 8
INVERSE_CDF_BLOCK = 256  # Weights summed per block by `inverse_cdf`'s first level.
_NO_STOP = -1
SHARED_PREFIX_MULTIPLE = 128  # See `shared_prefix`.


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How the next token is drawn from the logits (a compile-time constant).

  temperature 0 is greedy decoding (argmax). Otherwise logits are divided by the temperature,
  then top_k (0 = off) keeps the k largest, then top_p (1 = off) keeps the smallest set of the
  most likely tokens whose mass is >= top_p. Tokens tied with the last kept one are kept too.
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    if not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0 or int(self.top_k) != self.top_k:
      raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def unfiltered(self) -> bool:
    """No top-k or top-p: every token keeps its (temperature-scaled) probability."""
    return self.top_k == 0 and self.top_p == 1


def sampling_logits(logits: Array, params: SamplingParams) -> Array:
  """Logits [..., V] of the sampling distribution q: scaled, with dropped tokens at -inf.

  q = softmax(logits / temperature) restricted to the top-k tokens and then to the nucleus
  {the most likely tokens, in order, until their mass first reaches top_p}, renormalised.
  Greedy (temperature 0) is the point mass on the argmax (ties: the first index).
  """
  logits = logits.astype(jnp.float32)
  if params.greedy:
    best = jnp.argmax(logits, axis=-1)
    return jnp.where(jnp.arange(logits.shape[-1]) == best[..., None], 0.0, -jnp.inf)
  scaled = logits / params.temperature
  vocab = scaled.shape[-1]
  if params.unfiltered:
    return scaled
  if params.top_k:
    # The k largest in descending order; everything below the k-th is dropped.
    ranked, _ = jax.lax.top_k(scaled, min(params.top_k, vocab))
  else:
    ranked = -jnp.sort(-scaled, axis=-1)
  if params.top_p < 1:
    # Mass of the ranked tokens before each one (in the top-k renormalised distribution): a
    # token is kept while the mass before it is < top_p, i.e. the smallest set reaching top_p.
    probs = jax.nn.softmax(ranked, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.sum(mass_before < params.top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(ranked, kept - 1, axis=-1)
  else:
    threshold = ranked[..., -1:]
  return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample_tokens(keys: Array, logits: Array, params: SamplingParams) -> tuple[Array, Array, Array]:
  """Draws one token per row. keys [B] (typed PRNG keys), logits [B, V] f32.

  Returns the tokens [B] int32, log p(token) under softmax(logits) and log q(token) under the
  sampling distribution (`sampling_logits`). The draw's sums give log q's normaliser, which is
  log p's too when q is the model's distribution (temperature 1, no top-k or top-p): then the
  49k-way exponentials are taken once a step, not three times.
  """
  logits = logits.astype(jnp.float32)
  sample_logits = sampling_logits(logits, params)
  pick = lambda values: jnp.take_along_axis(values, tokens[:, None], axis=-1)[:, 0]
  logprob = lambda values: pick(values) - jax.nn.logsumexp(values, axis=-1)
  if params.greedy:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, logprob(logits), logprob(sample_logits)
  tokens, log_normaliser = _inverse_cdf(_uniform(keys), sample_logits)
  sampling_logprobs = pick(sample_logits) - log_normaliser
  if params.temperature == 1 and params.unfiltered:
    return tokens, sampling_logprobs, sampling_logprobs
  return tokens, logprob(logits), sampling_logprobs


def inverse_cdf(keys: Array, logits: Array) -> Array:
  """One draw per row from softmax(logits) [B, V], each row from its own key [B].

  With weights w_i = exp(logits_i - max), cumulative sums C_i = w_0 + ... + w_i and one
  uniform u per row, the draw is the first i with C_i > u * C_{V-1}: token i is drawn with
  probability w_i / sum(w). u lies on a 2^-23 grid in [0, 1), so u * C_{V-1} < C_{V-1} and a
  token of weight 0 (logit -inf) never wins: its C_i equals the C_{i-1} that did not pass.

  One random word per row (a race of exponentials, or Gumbel-max, takes one per vocabulary
  entry: at 49k entries generating them cost more than the rest of the draw). The sums run in
  two levels, over blocks of INVERSE_CDF_BLOCK weights and then inside the chosen block, so the
  scan is short; a rounding difference between the two levels can leave the threshold past the
  chosen block's last in-block sum, so the draw is kept at the block's last positive weight.
  """
  return inverse_cdf_at(_uniform(keys), logits)


def _uniform(keys: Array) -> Array:
  """One uniform [B] in [0, 1) on a 2^-23 grid per key [B]."""
  bits = jax.vmap(lambda key: jax.random.bits(key, (), jnp.uint32))(keys)
  return (bits >> 9).astype(jnp.float32) * 2.0**-23


def inverse_cdf_at(uniform: Array, logits: Array) -> Array:
  """The tokens [B] at which each row's cumulative distribution passes uniform [B] in [0, 1)
  (see `inverse_cdf`)."""
  return _inverse_cdf(uniform, logits)[0]


def _inverse_cdf(uniform: Array, logits: Array) -> tuple[Array, Array]:
  """`inverse_cdf_at`'s tokens [B] and each row's logsumexp(logits) [B], from the same sums."""
  batch, vocab = logits.shape
  peak = jnp.max(logits, axis=-1)
  weights = jnp.exp(logits - peak[:, None])
  block = INVERSE_CDF_BLOCK
  blocks = jnp.pad(weights, ((0, 0), (0, -vocab % block))).reshape(batch, -1, block)
  block_sums = jnp.cumsum(jnp.sum(blocks, axis=-1), axis=-1)  # [B, blocks]
  threshold = (uniform * block_sums[:, -1])[:, None]
  chosen = jnp.sum(block_sums <= threshold, axis=-1)  # < blocks, as threshold < the total.
  before = jnp.take_along_axis(jnp.pad(block_sums, ((0, 0), (1, 0))), chosen[:, None], axis=1)
  inner = jnp.take_along_axis(blocks, chosen[:, None, None], axis=1)[:, 0]  # [B, block]
  within = jnp.sum(before + jnp.cumsum(inner, axis=-1) <= threshold, axis=-1)
  last_positive = block - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
  tokens = (chosen * block + jnp.minimum(within, last_positive)).astype(jnp.int32)
  return tokens, peak + jnp.log(block_sums[:, -1])


@struct.dataclass
class SamplerState:
  """A live batch: the KV cache and each row's final hidden state after its last cached token."""

  cache: KVCache
  hidden: Array  # [batch, embed] f32

  @property
  def lengths(self) -> Array:
    """[batch] tokens held by each row (prompt, appended and generated)."""
    return self.cache.lengths


@struct.dataclass
class SampleOutput:
  """What one `generate` call produced; entries past a row's length are padding (0)."""

  tokens: Array  # [batch, max_new_tokens] int32
  logprobs: Array  # [batch, max_new_tokens] f32: log p(token), the model at temperature 1
  sampling_logprobs: Array  # [batch, max_new_tokens] f32: log q(token), the sampled distribution
  lengths: Array  # [batch] int32: tokens generated per row
  stopped: Array  # [batch] bool: the row ended on a stop id (else budget or a full cache)

  def token_lists(self) -> list[list[int]]:
    """The generated ids of each row, on the host."""
    tokens, lengths = jax.device_get((self.tokens, self.lengths))
    return [row[:n].tolist() for row, n in zip(tokens, lengths)]


def bucket(n: int, floor: int, cap: int | None = None) -> int:
  """The smallest 2^k or 3 * 2^(k-1) >= n, at least `floor` and at most `cap` (which then is a
  bucket too).

  Two sizes an octave keep the compiled shapes few and the padding under a third: a power of
  two alone pads a 560-token prompt to 1024, nearly doubling its prefill.
  """
  power = 1 << max(int(n) - 1, 0).bit_length()
  size = max(floor, 3 * power // 4 if 3 * power // 4 >= n else power)
  return size if cap is None else min(size, cap)


def shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
  """How many leading tokens a start prefills once for all its distinct prompts: their longest
  common prefix, short of the shortest prompt (each prompt keeps a token of its own, whose
  hidden state starts its decode), cut down to a multiple of SHARED_PREFIX_MULTIPLE.

  The cut keeps the prefix's program shape from step to step (prompts that share an
  instruction and first differ a few tokens later or earlier share it) and leaves at most
  SHARED_PREFIX_MULTIPLE - 1 common tokens to each prompt's own prefill.
  """
  first, last = min(map(tuple, prompts)), max(map(tuple, prompts))
  limit = min(map(len, prompts)) - 1
  common = 0
  while common < limit and first[common] == last[common]:
    common += 1  # The common prefix of a set is that of its lexicographic extremes.
  return common - common % SHARED_PREFIX_MULTIPLE


def _map_state(fn: Callable[[Array, tuple[str, ...]], Array], state: SamplerState) -> SamplerState:
  """Applies fn(array, logical axes) to every array of a state."""
  cache = state.cache
  layers = lambda bits: tuple(fn(layer, KVCache.AXES) for layer in bits)
  return SamplerState(
      cache=cache.replace(k=layers(cache.k), v=layers(cache.v),
                          lengths=fn(cache.lengths, ("batch",))),
      hidden=fn(state.hidden, ("batch", "activation_embed")))


def _constrain(state: SamplerState) -> SamplerState:
  """Keeps a state in its logical sharding inside a jitted function (a no-op without a mesh)."""
  return _map_state(sharding.constrain, state)


def _layout(graphdef: nnx.GraphDef, params: nnx.State) -> list[DecodeLayer]:
  """The weights of every layer out of their stack, as the cached path reads them."""
  return nnx.merge(graphdef, params).cached_layers()


def _prefill(graphdef: nnx.GraphDef, params: nnx.State, state: SamplerState, tokens: Array,
             counts: Array, rows: Array | None = None, *, window: int,
             layers: Sequence[DecodeLayer] | None = None) -> SamplerState:
  """Appends tokens [B, T] (row b's first counts[b] are real) at each row's end; `layers` are
  the params' `_layout` when the caller keeps it (None: taken here). With `rows` [R] (distinct)
  tokens [R, T] go to the end of cache rows[r], computed on those rows alone (`Cached.rows`):
  a prefill costs what its rows need, not what the whole batch would.

  Rows with counts[b] = 0 are unchanged: their (padding) writes land past their length.
  """
  model = nnx.merge(graphdef, params)
  mask = jnp.arange(tokens.shape[1])[None, :] < counts[:, None]
  hidden, cache = model.hidden_states(tokens, attention_mask=mask,
                                      cached=Cached(state.cache, window, layers, rows))
  last = jnp.take_along_axis(hidden, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]
  if rows is None:
    hidden = jnp.where((counts > 0)[:, None], last, state.hidden)
  else:
    hidden = state.hidden.at[rows].set(jnp.where((counts > 0)[:, None], last, state.hidden[rows]))
  return _constrain(SamplerState(cache=cache, hidden=hidden))


def _prefill_rows(graphdef: nnx.GraphDef, params: nnx.State, state: SamplerState, tokens: Array,
                  counts: Array, rows: Array, *, window: int,
                  layers: Sequence[DecodeLayer] | None = None) -> SamplerState:
  """`_prefill` on the cache rows `rows` alone: a function of its own, whose programs are
  compiled and counted apart."""
  return _prefill(graphdef, params, state, tokens, counts, rows, window=window, layers=layers)


def _prefill_shared(graphdef: nnx.GraphDef, params: nnx.State, state: SamplerState,
                    prefix: Array | None, tokens: Array, counts: Array, sources: Array, *,
                    window: int, layers: Sequence[DecodeLayer] | None = None) -> SamplerState:
  """Prefills the distinct prompts once, on U rows of their own, and copies prompt sources[b]
  into every row b with sources[b] >= 0 (rows that were empty; the others are unchanged).

  Prompt u is `prefix` [P] (every prompt's first P tokens; None for P = 0) followed by
  tokens[u, :counts[u]]. The prefix is prefilled once, on one row, and its keys and values
  broadcast to the U rows before their own tokens are appended. The copy reads and writes only
  the first `window` slots of the cache, which hold the prompts. `layers` as in `_prefill`.
  """
  model = nnx.merge(graphdef, params)
  layers = model.cached_layers() if layers is None else layers
  distinct = tokens.shape[0]
  if prefix is None:
    prompts = KVCache.zeros(model.config, distinct, window, state.cache.dtype)
  else:
    prompts = KVCache.zeros(model.config, 1, window, state.cache.dtype)
    _, prompts = model.hidden_states(prefix[None], cached=Cached(prompts, prefix.shape[0], layers))
    rows = lambda bits: tuple(jnp.broadcast_to(x, (distinct,) + x.shape[1:]) for x in bits)
    prompts = prompts.replace(k=rows(prompts.k), v=rows(prompts.v),
                              lengths=jnp.broadcast_to(prompts.lengths, (distinct,)))
  mask = jnp.arange(tokens.shape[1])[None, :] < counts[:, None]
  hidden, prompts = model.hidden_states(tokens, attention_mask=mask,
                                        cached=Cached(prompts, layers=layers))
  last = jnp.take_along_axis(hidden, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]
  copied = sources >= 0
  source = jnp.maximum(sources, 0)

  def place(bits: Array, prompt_bits: Array) -> Array:
    new = jnp.where(copied[:, None, None, None], jnp.take(prompt_bits, source, axis=0),
                    bits[:, :, :window])
    return jax.lax.dynamic_update_slice_in_dim(bits, new, 0, axis=2)

  layers = lambda bits, prompt_bits: tuple(map(place, bits, prompt_bits))
  cache = state.cache.replace(
      k=layers(state.cache.k, prompts.k), v=layers(state.cache.v, prompts.v),
      lengths=jnp.where(copied, prompts.lengths[source], state.cache.lengths))
  hidden = jnp.where(copied[:, None], last[source], state.hidden)
  return _constrain(SamplerState(cache=cache, hidden=hidden))


def _decode(graphdef: nnx.GraphDef, params: nnx.State, state: SamplerState, keys: Array,
            offsets: Array, budget: Array, stop_ids: Array, rows: Array | None = None,
            shrink_at: Array | int = 0, *, width: int, sampling: SamplingParams,
            layers: Sequence[DecodeLayer] | None = None) -> tuple[SamplerState, SampleOutput]:
  """Samples up to budget[b] <= width tokens per row inside one lax.while_loop, row b's k-th
  with the key fold_in(keys[b], offsets[b] + k); `layers` as in `_prefill`. The loop also ends
  once no more than `shrink_at` rows are live (0: only when none is), leaving those rows short of
  their budget and unstopped: a smaller program can continue them.

  Each step samples a token from every live row's logits and runs the forward pass on it, so
  the cache always holds every sampled token and `hidden` the state after it. Finished rows
  still flow through the (static-shape) step, masked: they write nothing past their length and
  their attention reads no slot. The layers' weights leave their stack before the loop. With
  `rows` [R] (distinct) the loop computes on those rows of the cache alone (`Cached.rows`), and
  the outputs of the other rows are padding: a decode of a few live rows costs what they need.
  """
  model = nnx.merge(graphdef, params)
  layers = model.cached_layers() if layers is None else layers
  if rows is not None:
    keys, offsets, budget = keys[rows], offsets[rows], budget[rows]
  batch = budget.shape[0]
  zeros = lambda dtype: jnp.zeros((batch, width), dtype)
  out = SampleOutput(tokens=zeros(jnp.int32), logprobs=zeros(jnp.float32),
                     sampling_logprobs=zeros(jnp.float32), lengths=jnp.zeros(
                         (batch,), jnp.int32), stopped=jnp.zeros((batch,), bool))

  def cond(carry):
    step, _, _, done, _ = carry
    return (step < width) & (jnp.sum(~done) > shrink_at)

  def body(carry):
    step, cache, hidden, done, out = carry
    live = ~done
    logits = model.logits(hidden)
    step_keys = jax.vmap(jax.random.fold_in)(keys, offsets + step)
    tokens, logprobs, sampling_logprobs = sample_tokens(step_keys, logits, sampling)
    tokens = jnp.where(live, tokens, 0)
    column = lambda values, new: jax.lax.dynamic_update_index_in_dim(
        values, jnp.where(live, new, jnp.zeros_like(new)), step, axis=1)
    stop = live & jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
    out = SampleOutput(tokens=column(out.tokens, tokens), logprobs=column(out.logprobs, logprobs),
                       sampling_logprobs=column(out.sampling_logprobs, sampling_logprobs),
                       lengths=out.lengths + live, stopped=out.stopped | stop)
    new_hidden, cache = model.hidden_states(tokens[:, None], attention_mask=live[:, None],
                                            cached=Cached(cache, layers=layers, rows=rows))
    hidden = jnp.where(live[:, None], new_hidden[:, 0], hidden)
    done = done | stop | (out.lengths >= budget)
    return step + 1, cache, hidden, done, out

  hidden = state.hidden if rows is None else state.hidden[rows]
  _, cache, hidden, _, out = jax.lax.while_loop(
      cond, body, (jnp.int32(0), state.cache, hidden, budget <= 0, out))
  if rows is not None:
    hidden = state.hidden.at[rows].set(hidden)
    out = jax.tree.map(
        lambda part: jnp.zeros(hidden.shape[:1] + part.shape[1:], part.dtype).at[rows].set(part),
        out)
  return _constrain(SamplerState(cache=cache, hidden=hidden)), out


class Sampler:
  """Compiled prefill/decode for one model on a static [max_batch, cache_slots] KV cache.

  Args:
    model: the policy; its graph is compiled once, its params are an argument (see module doc).
    cache_slots: tokens each row can hold over a whole episode (prompt, turns, generations).
    max_batch: rows of the compiled programs; `start` may fill fewer.
    cache_dtype: dtype of the cached keys and values (default: the model's matmul dtype).
    mesh: place the state over a (data, fsdp, tensor) mesh; None for one device.
    min_bucket: the smallest padded prompt/append length.
    min_window: the smallest attention window (cache prefix read by a prefill).
    keep_layout: keep the layers' weights out of their stack (`Decoder.cached_layers`) between
      calls, for the params last used, instead of taking them out in every call: one more copy
      of the layer weights in memory for no per-call copy. Default: on CPU only, where the copy
      costs what 4-5 decode steps of a 135M model do (~190 ms on a 2-core Zen 4) and memory is
      plentiful; an accelerator copies the weights at its memory bandwidth, a few percent of
      a call, and its memory is what limits the batch.
    compact_decode: a decode of few rows computes on those rows alone (`decode_rows`): one
      program per row-count bucket. Default (and only possible): when no mesh splits the rows
      (under one that does, each device decodes the rows it holds).
  """

  def __init__(self, model: Decoder, *, cache_slots: int, max_batch: int, cache_dtype: Any = None,
               mesh: Mesh | None = None, min_bucket: int = 16, min_window: int = 128,
               keep_layout: bool | None = None, compact_decode: bool | None = None):
    if cache_slots <= 0 or max_batch <= 0:
      raise ValueError(f"cache_slots ({cache_slots}) and max_batch ({max_batch}) must be > 0")
    if min_bucket <= 0 or min_window <= 0:
      raise ValueError(f"min_bucket ({min_bucket}) and min_window ({min_window}) must be > 0")
    self.config = model.config
    self.cache_slots = cache_slots
    self.max_batch = max_batch
    self.cache_dtype = jnp.dtype(cache_dtype or model.dtype)
    self.mesh = mesh
    self.min_bucket = min_bucket
    self.min_window = min_window
    self.graphdef, self.params = nnx.split(model)
    if keep_layout is None:
      devices = jax.tree.leaves(self.params)[0].devices()
      keep_layout = all(device.platform == "cpu" for device in devices)
    self.keep_layout = keep_layout
    whole_rows = mesh is None or sharding.batch_shards(mesh) == 1
    self.compact_decode = whole_rows if compact_decode is None else compact_decode
    if self.compact_decode and not whole_rows:
      raise ValueError("compact_decode needs the rows unsplit; this mesh splits them over "
                       f"{sharding.batch_shards(mesh)} devices, each decoding the rows it holds")
    self._kept: tuple[list[Array], list[DecodeLayer]] | None = None  # params' leaves, layout
    self._layout = jax.jit(functools.partial(_layout, self.graphdef))
    # The state is donated: its cache is updated in place instead of copied every call.
    self._prefill = jax.jit(functools.partial(_prefill, self.graphdef), static_argnames=("window",),
                            donate_argnums=(1,))
    self._prefill_rows = jax.jit(functools.partial(_prefill_rows, self.graphdef),
                                 static_argnames=("window",), donate_argnums=(1,))
    self._prefill_shared = jax.jit(functools.partial(_prefill_shared, self.graphdef),
                                   static_argnames=("window",), donate_argnums=(1,))
    self._decode = jax.jit(functools.partial(_decode, self.graphdef),
                           static_argnames=("width", "sampling"), donate_argnums=(1,))

  def empty(self) -> SamplerState:
    """A state whose rows hold nothing."""
    cache = KVCache.zeros(self.config, self.max_batch, self.cache_slots, self.cache_dtype)
    state = SamplerState(cache=cache, hidden=jnp.zeros((self.max_batch, self.config.hidden_size),
                                                       jnp.float32))
    if self.mesh is None:
      return state
    return _map_state(
        lambda x, axes: jax.device_put(x, sharding.named_sharding(self.mesh, axes, x.shape)), state)

  def start(self, prompts: Sequence[Sequence[int]],
            params: nnx.State | None = None) -> SamplerState:
    """Prefills rows 0..len(prompts)-1 with the prompts (the other rows stay empty)."""
    if not 0 < len(prompts) <= self.max_batch:
      raise ValueError(f"start takes 1..{self.max_batch} prompts, got {len(prompts)}")
    if any(len(prompt) == 0 for prompt in prompts):
      raise ValueError("every prompt needs at least one token")
    return self.append(self.empty(), dict(enumerate(prompts)), params)

  def append(self, state: SamplerState, rows_tokens: Mapping[int, Sequence[int]],
             params: nnx.State | None = None) -> SamplerState:
    """Appends token ids to the listed rows (e.g. an observation turn and the assistant header).

    Rows not listed, or listed with no ids, are unchanged. The new ids are prefilled in one
    call, attending to everything the rows already hold. A call on at most a quarter of the
    rows (a row rejoining the decode, the last episodes of a step) computes on a quarter of
    the batch only (`_prefill_rows`): one more program a length bucket, for 4x less work. When
    every listed row is empty (the start of episodes), each distinct list of ids is prefilled
    once and copied into the rows that share it: the samples of one task share their prompt.
    The tokens the distinct lists all begin with (an instruction every task's prompt opens
    with; `shared_prefix`) are prefilled once for all of them. Empty rows listed beside rows
    that hold tokens (a refilled row's prompt beside the others' observations) are prefilled
    that way in a call of their own when their ids need a wider bucket than the others'.
    """
    lengths = self._lengths(state, None)
    counts = np.zeros(self.max_batch, np.int32)
    for row, ids in rows_tokens.items():
      self._check_row(row)
      counts[row] = len(ids)
      if lengths[row] + len(ids) > self.cache_slots:
        raise ValueError(f"row {row} holds {lengths[row]} tokens; appending {len(ids)} exceeds "
                         f"cache_slots={self.cache_slots}")
    if not counts.any():
      return state
    fresh = (counts > 0) & (lengths == 0)
    if not (counts[~fresh] > 0).any():  # Every listed row is empty.
      return self._append_shared(state, rows_tokens, params)
    if fresh.any() and bucket(counts[fresh].max(), self.min_bucket) > bucket(
        counts[~fresh].max(), self.min_bucket):
      # New episodes' prompts beside other rows' observations: the prompts in a call of their
      # own, so that the observations are not padded to a prompt's width.
      state = self._append_shared(state, {row: rows_tokens[row] for row in np.flatnonzero(fresh)},
                                  params)
      counts[fresh] = 0
      rows_tokens = {row: ids for row, ids in rows_tokens.items() if not fresh[row]}
    width = bucket(counts.max(), self.min_bucket)
    listed = np.flatnonzero(counts)
    if len(listed) <= self.max_batch // 4:
      # The listed rows, then rows with nothing to append, up to a quarter of the batch.
      size = self.max_batch // 4
      rows = np.concatenate([listed, np.flatnonzero(counts == 0)[:size - len(listed)]])
      tokens = np.zeros((size, width), np.int32)
      for i, row in enumerate(listed):
        tokens[i, :counts[row]] = np.asarray(rows_tokens[row], np.int32)
      window = self._window((lengths + counts)[listed].max())
      with self._mesh_context():
        return self._prefill_rows(self._params(params), state, tokens, counts[rows],
                                  rows.astype(np.int32), window=window, layers=self._layers(params))
    tokens = np.zeros((self.max_batch, width), np.int32)
    for row, ids in rows_tokens.items():
      tokens[row, :len(ids)] = np.asarray(ids, np.int32)
    window = self._window((lengths + counts).max())
    with self._mesh_context():
      return self._prefill(self._params(params), state, self._place_batch(tokens),
                           self._place_batch(counts), window=window, layers=self._layers(params))

  def release(self, state: SamplerState, rows: Sequence[int]) -> SamplerState:
    """Empties `rows`, so that the next `append` to one prefills a new sequence there (the next
    episode of a finished row, or a rewritten context) while the other rows keep theirs. The
    released rows' keys and values stay in the cache past their length of 0, where attention
    never reads (as every row's padding writes do)."""
    for row in rows:
      self._check_row(row)
    if not rows:
      return state
    # A mask of every row, not the rows' indices: one program whatever their count.
    released = np.zeros(self.max_batch, bool)
    released[list(rows)] = True
    lengths = jnp.where(jnp.asarray(released), 0, state.cache.lengths)
    return state.replace(cache=state.cache.replace(lengths=lengths))

  def _append_shared(self, state: SamplerState, rows_tokens: Mapping[int, Sequence[int]],
                     params: nnx.State | None) -> SamplerState:
    """`append` to empty rows: each distinct list of ids prefilled once, after the prefix they
    all share (`shared_prefix`) prefilled once, then copied."""
    distinct: dict[tuple[int, ...], int] = {}
    sources = np.full(self.max_batch, -1, np.int32)
    for row, ids in rows_tokens.items():
      if len(ids):
        sources[row] = distinct.setdefault(tuple(ids), len(distinct))
    shared = shared_prefix(list(distinct)) if len(distinct) > 1 else 0
    width = bucket(max(map(len, distinct)) - shared, self.min_bucket)
    tokens = np.zeros((bucket(len(distinct), 1, self.max_batch), width), np.int32)
    counts = np.zeros(tokens.shape[0], np.int32)
    for ids, index in distinct.items():
      tokens[index, :len(ids) - shared] = ids[shared:]
      counts[index] = len(ids) - shared
    prefix = jnp.asarray(next(iter(distinct))[:shared], jnp.int32) if shared else None
    window = self._window(shared + counts.max())
    with self._mesh_context():
      return self._prefill_shared(self._params(params), state, prefix, jnp.asarray(tokens),
                                  jnp.asarray(counts), self._place_batch(sources), window=window,
                                  layers=self._layers(params))

  def generate(self, state: SamplerState, key: Array, *, max_new_tokens: int,
               stop_ids: Sequence[int] = (), rows: Sequence[int] | None = None,
               sampling: SamplingParams = SamplingParams(), params: nnx.State | None = None,
               lengths: Sequence[int] | None = None, budgets: Sequence[int] | None = None,
               offsets: Sequence[int] | None = None,
               shrink: bool = False) -> tuple[SamplerState, SampleOutput]:
    """Samples up to max_new_tokens per row, continuing each row from its live cache.

    Args:
      state: the live state (donated; continue from the returned one).
      key: one PRNG key (row b uses fold_in(key, b)) or one key per row ([max_batch]); a row's
        k-th token of the call draws with fold_in(its key, offsets[b] + k).
      max_new_tokens: the per-row budget of this call.
      stop_ids: a row stops after sampling any of these (e.g. the chat turn end).
      rows: the rows to decode (default: every row holding tokens); others generate nothing.
      sampling: how each token is drawn (temperature, top_p, top_k).
      params: policy params to use instead of the sampler's own.
      lengths: the tokens each row holds ([max_batch]), if the caller keeps count; otherwise
        they are read back from the state, which waits for the device to finish the state's
        pending work (so a call could not be queued behind work still running).
      budgets: per row, at most this many tokens (<= max_new_tokens; default max_new_tokens).
      offsets: per row, the index of its first token here among the tokens of one reply
        (default 0): a reply continued over several calls samples what one call would.
      shrink: with `compact_decode`, end the call once half or fewer of the rows it computes
        on (`decode_rows`) are still live, if a smaller program would hold them: those rows
        come back short of their budget and unstopped, for the caller to continue in a call on
        them alone. Rows that ended early then stop costing row-steps beside the longest reply.

    Returns:
      The new state and a `SampleOutput` of width max_new_tokens.
    """
    if max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if len(stop_ids) > MAX_STOP_IDS:
      raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(stop_ids)}")
    lengths = self._lengths(state, lengths)
    if rows is None:
      active = lengths > 0
    else:
      active = np.zeros(self.max_batch, bool)
      for row in rows:
        self._check_row(row)
        active[row] = True
      if (lengths[active] == 0).any():
        raise ValueError(f"rows {np.flatnonzero(active & (lengths == 0)).tolist()} hold no "
                         "tokens to continue from; start or append to them first")
    limit = max_new_tokens if budgets is None else self._per_row(budgets, "budgets")
    if np.any(limit > max_new_tokens):
      raise ValueError(f"budgets {np.asarray(limit).tolist()} exceed max_new_tokens="
                       f"{max_new_tokens}")
    budget = np.where(active, np.minimum(limit, self.cache_slots - lengths), 0)
    offsets = np.zeros(self.max_batch, np.int32) if offsets is None else self._per_row(
        offsets, "offsets")
    keys = self._row_keys(key)
    stops = np.full(MAX_STOP_IDS, _NO_STOP, np.int32)
    stops[:len(stop_ids)] = stop_ids
    computed = self.decode_rows(active)
    rows = None if len(computed) == self.max_batch else computed.astype(np.int32)
    half = len(computed) // 2
    smaller = self.compact_decode and bucket(half, 2, self.max_batch) < len(computed)
    shrink_at = np.int32(half if shrink and smaller else 0)
    layers, width = self._layers(params), bucket(max_new_tokens, 1)
    with self._mesh_context():
      state, out = self._decode(self._params(params), state, keys, self._place_batch(offsets),
                                self._place_batch(budget.astype(np.int32)), jnp.asarray(stops),
                                rows, shrink_at, width=width, sampling=sampling, layers=layers)
    if out.tokens.shape[1] != max_new_tokens:
      out = jax.tree.map(lambda x: x[:, :max_new_tokens] if x.ndim == 2 else x, out)
    return state, out

  def decode_rows(self, active: np.ndarray) -> np.ndarray:
    """The rows a decode of the `active` rows (a [max_batch] mask) computes on: every row, or
    with `compact_decode`, when bucket(active rows) < max_batch, the active rows and then the
    first others (which decode nothing) up to that bucket: the padding stays under a third.
    Never fewer than 2 rows: XLA:CPU runs a one-row program's matrix-vector products slower
    than a two-row program's matrix products (benchmarks/sampler_calls.py: 627 against 521 ms
    for 16 tokens of SmolLM2 in bf16 on a Zen 4)."""
    listed = np.flatnonzero(active)
    size = bucket(len(listed), 2, self.max_batch)
    if not self.compact_decode or size == self.max_batch:
      return np.arange(self.max_batch)
    return np.concatenate([listed, np.flatnonzero(~active)[:size - len(listed)]])

  def _params(self, params: nnx.State | None) -> nnx.State:
    return self.params if params is None else params

  def _layers(self, params: nnx.State | None) -> list[DecodeLayer] | None:
    """The kept layout of `params` (`keep_layout`), made when they are not the params it was
    made from (compared array by array: an update makes new arrays); None when not kept."""
    if not self.keep_layout:
      return None
    leaves = jax.tree.leaves(self._params(params))
    kept = self._kept  # One read: another thread may replace it meanwhile.
    if kept is None or len(kept[0]) != len(leaves) or any(
        a is not b for a, b in zip(kept[0], leaves)):
      self._kept = kept = None  # The old layout's memory is free before the new one is made.
      with self._mesh_context():
        kept = (leaves, self._layout(self._params(params)))
      self._kept = kept
    return kept[1]

  def _check_row(self, row: int) -> None:
    if not 0 <= row < self.max_batch:
      raise ValueError(f"row {row} is outside 0..{self.max_batch - 1}")

  def _lengths(self, state: SamplerState, lengths: Sequence[int] | None) -> np.ndarray:
    if lengths is None:
      return np.asarray(jax.device_get(state.cache.lengths))
    return self._per_row(lengths, "lengths")

  def _per_row(self, values: Sequence[int], name: str) -> np.ndarray:
    values = np.asarray(values, np.int32)
    if values.shape != (self.max_batch,) or (values < 0).any():
      raise ValueError(f"{name} must be {self.max_batch} integers >= 0, got "
                       f"{values.tolist()}")
    return values

  def _window(self, end: int) -> int:
    """The attention window covering slots [0, end)."""
    return bucket(end, self.min_window, self.cache_slots)

  def _row_keys(self, key: Array) -> Array:
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
      key = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(self.max_batch))
    if key.shape != (self.max_batch,):
      raise ValueError(f"key must be one PRNG key or {self.max_batch} keys, got shape "
                       f"{key.shape}")
    return key

  def _place_batch(self, array: np.ndarray) -> Array:
    if self.mesh is None:
      return jnp.asarray(array)
    axes = ("batch",) + (None,) * (array.ndim - 1)
    return jax.device_put(array, sharding.named_sharding(self.mesh, axes, array.shape))

  def _mesh_context(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()
