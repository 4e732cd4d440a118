"""The sampler against plain forward passes: tokens, log-probs, multi-turn continuation, keys,
batch-composition independence, sampling filters, compile counts and sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import monitoring
from jax.sharding import NamedSharding, PartitionSpec as P

from agentgym_jax import sampling, sharding
from agentgym_jax.models import decoder, weights
from agentgym_jax.models.config import ModelConfig
from agentgym_jax.models.decoder import Decoder
from agentgym_jax.sampling import Sampler, SamplingParams, bucket, sample_tokens, sampling_logits

import tolerances

CONFIG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     tie_word_embeddings=True)
SLOTS = 128


def _logprob_tolerance(reference: np.ndarray) -> float:
  """The reordering error model (tests/tolerances.py) for CONFIG's log-probs, at the scale of the
  log-probs compared, or 1 if smaller (the random model's logits are of order 1)."""
  return tolerances.reordered_logprobs(CONFIG.num_layers, CONFIG.intermediate_size,
                                       max(float(np.abs(reference).max()), 1.0))


BATCH = 4


@pytest.fixture(scope="module")
def model():
  return nnx.jit(lambda: Decoder(CONFIG, rngs=nnx.Rngs(0)))()


@pytest.fixture(scope="module")
def forward(model):
  """Log-probs [T, V] of one whole sequence by a plain forward pass (no cache)."""
  logits_fn = nnx.jit(lambda model, ids: model(ids))

  def logprobs(ids):
    # Right padding to a multiple of 32 changes no earlier position and bounds compilations.
    padded = np.zeros((1, -(-len(ids) // 32) * 32), np.int32)
    padded[0, :len(ids)] = ids
    return np.asarray(jax.nn.log_softmax(logits_fn(model, jnp.asarray(padded))[0, :len(ids)]))

  return logprobs


def _prompts(lengths, seed=0):
  rng = np.random.RandomState(seed)
  return [rng.randint(1, CONFIG.vocab_size, size=n).tolist() for n in lengths]


def test_greedy_equals_the_argmax_continuation_of_forward_passes(model, forward):
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  prompts = _prompts([3, 9, 1])
  state = sampler.start(prompts)
  state, out = sampler.generate(state, jax.random.key(0), max_new_tokens=12,
                                sampling=SamplingParams(temperature=0.0))
  assert out.lengths.tolist() == [12, 12, 12, 0]  # row 3 holds nothing and is skipped
  for row, prompt in enumerate(prompts):
    sequence = list(prompt)
    for _ in range(12):
      sequence.append(int(np.argmax(forward(sequence)[-1])))
    assert out.token_lists()[row] == sequence[len(prompt):]
  # Greedy samples from a point mass: log q = 0.
  np.testing.assert_array_equal(np.asarray(out.sampling_logprobs), 0.0)
  assert np.asarray(state.lengths).tolist() == [15, 21, 13, 0]


@pytest.mark.slow
def test_logprobs_equal_the_forward_pass_over_a_multi_turn_episode(model, forward):
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH, min_bucket=4, min_window=16)
  sampling = SamplingParams(temperature=0.8, top_k=20)
  sequences = _prompts([5, 2, 11])
  generated = [[] for _ in sequences]  # (position, token, logprob, sampling logprob)
  state = sampler.start(sequences)
  appends = [
      {0: [7, 8, 9], 1: [3] * 13, 2: [4, 5]},
      {0: [10] * 6, 2: [11]},  # row 1's episode is over: it appends nothing...
      {0: [12], 2: [13] * 9}
  ]
  for turn in range(4):
    rows = [0, 2] if turn >= 2 else None  # ...and generates nothing from turn 2 on.
    state, out = sampler.generate(state, jax.random.key(turn), rows=rows,
                                  max_new_tokens=5 + 2 * turn, sampling=sampling)
    for row, tokens in enumerate(out.token_lists()[:3]):
      assert len(tokens) == (0 if rows and row not in rows else 5 + 2 * turn)
      for t, token in enumerate(tokens):
        generated[row].append((len(sequences[row]) - 1, token, float(out.logprobs[row, t]),
                               float(out.sampling_logprobs[row, t])))
        sequences[row].append(token)
    if turn < 3:
      state = sampler.append(state, appends[turn])
      for row, ids in appends[turn].items():
        sequences[row] += ids
  assert np.asarray(state.lengths)[:3].tolist() == [len(s) for s in sequences]
  for row, sequence in enumerate(sequences):
    logprobs = forward(sequence)
    sampling_logprobs = np.asarray(jax.nn.log_softmax(sampling_logits(logprobs, sampling)))
    for position, token, logprob, sampling_logprob in generated[row]:
      assert abs(logprob - logprobs[position, token]) <= 1e-4
      assert abs(sampling_logprob - sampling_logprobs[position, token]) <= 1e-4


def test_same_key_same_output_and_another_key_another(model):
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  prompts = _prompts([4, 6, 3, 8])

  def run(key):
    _, out = sampler.generate(sampler.start(prompts), key, max_new_tokens=16)
    return np.asarray(out.tokens), np.asarray(out.logprobs)

  first, again, other = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
  np.testing.assert_array_equal(first[0], again[0])
  np.testing.assert_array_equal(first[1], again[1])
  assert (first[0] != other[0]).any()


def test_lengths_kept_by_the_caller_replace_reading_them_back(model):
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  prompts = _prompts([4, 6, 3])

  def run(lengths):
    _, out = sampler.generate(sampler.start(prompts), jax.random.key(3), max_new_tokens=8,
                              lengths=lengths)
    return np.asarray(out.tokens), np.asarray(out.logprobs), np.asarray(out.lengths)

  read_back, kept = run(None), run([4, 6, 3, 0])
  for a, b in zip(read_back, kept):
    np.testing.assert_array_equal(a, b)
  assert kept[2][3] == 0  # The empty row is not decoded.
  with pytest.raises(ValueError, match="lengths must be 4 integers >= 0"):
    run([4, 6, 3])


def test_a_reply_sampled_in_chunks_draws_what_one_call_draws(model):
  # Chunks of 3, 2 and 5 tokens, each row's keys continued from its offset: the same tokens
  # and log-probs as one call of 10, whatever chunk each row's tokens fell in.
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  prompts = _prompts([4, 6, 3, 5])
  key = jax.random.key(11)
  _, whole = sampler.generate(sampler.start(prompts), key, max_new_tokens=10)
  state, parts, sampled = sampler.start(prompts), [], np.zeros(BATCH, np.int32)
  for chunk in (3, 2, 5):
    budgets = np.full(BATCH, chunk)
    budgets[1] = min(chunk, 4 - sampled[1])  # Row 1 gets 4 tokens in all, over the first two.
    state, out = sampler.generate(state, key, max_new_tokens=chunk, budgets=budgets,
                                  offsets=sampled)
    parts.append(out)
    sampled += np.asarray(out.lengths)
  for row in range(BATCH):
    tokens = np.concatenate([np.asarray(p.tokens)[row, :int(p.lengths[row])] for p in parts])
    logprobs = np.concatenate(
        [np.asarray(p.sampling_logprobs)[row, :int(p.lengths[row])] for p in parts])
    count = 4 if row == 1 else 10
    np.testing.assert_array_equal(tokens, np.asarray(whole.tokens)[row, :count])
    # The same program on the same cache: the same sums, bit for bit.
    np.testing.assert_array_equal(logprobs, np.asarray(whole.sampling_logprobs)[row, :count])
  # Without the offsets each chunk would restart the row's draws.
  restarted = sampler.generate(sampler.start(prompts), key, max_new_tokens=3)[1]
  again = sampler.generate(sampler.start(prompts), key, max_new_tokens=3, offsets=[3] * BATCH)[1]
  assert (np.asarray(restarted.tokens) != np.asarray(again.tokens)).any()
  with pytest.raises(ValueError, match="exceed max_new_tokens=3"):
    sampler.generate(sampler.start(prompts), key, max_new_tokens=3, budgets=[4, 0, 0, 0])
  with pytest.raises(ValueError, match="offsets must be 4 integers >= 0"):
    sampler.generate(sampler.start(prompts), key, max_new_tokens=3, offsets=[0, -1, 0, 0])


def test_a_row_does_not_depend_on_the_other_rows(model):
  """Row 1 samples the same episode whatever rows 0, 2 and 3 hold, when they stop, or whether
  they are there at all."""
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH, min_window=16)
  ours = _prompts([6])[0]
  key = jax.random.key(3)

  def episode(others, stop_ids):
    rows = {1: ours, **others}
    state = sampler.append(sampler.empty(), rows)
    state, first = sampler.generate(state, key, max_new_tokens=9, stop_ids=stop_ids,
                                    rows=sorted(rows))
    state = sampler.append(state, {1: [5, 6, 7], **{row: [9] * 20 for row in others}})
    state, second = sampler.generate(state, jax.random.key(4), max_new_tokens=7, rows=sorted(rows))
    return [(np.asarray(out.tokens[1]), np.asarray(out.logprobs[1]),
             np.asarray(out.sampling_logprobs[1])) for out in (first, second)]

  alone = episode({}, stop_ids=())
  crowded = episode({0: _prompts([30], seed=1)[0], 3: [2]}, stop_ids=())
  # Row 2 stops on its third token (one row 1 never samples in its first turn), then skips a
  # turn's worth of steps while row 1 carries on.
  row_2 = _prompts([17], seed=2)[0]
  state = sampler.append(sampler.empty(), {1: ours, 2: row_2})
  _, free = sampler.generate(state, key, max_new_tokens=9)
  stop = next(t for t in free.token_lists()[2][2:] if t not in alone[0][0].tolist())
  early = episode({2: row_2}, stop_ids=[stop])
  for other in (crowded, early):
    for (tokens, logprobs, sampling_logprobs), (ref_tokens, ref_logprobs,
                                                ref_sampling) in zip(other, alone):
      # Other rows change only the shapes XLA blocks its sums by: the reordering error model.
      # (A draw could flip only where a uniform falls within that error of a CDF boundary,
      # probability ~1e-6 a token.)
      np.testing.assert_array_equal(tokens, ref_tokens)
      np.testing.assert_allclose(logprobs, ref_logprobs, atol=_logprob_tolerance(ref_logprobs),
                                 rtol=0)
      np.testing.assert_allclose(sampling_logprobs, ref_sampling, rtol=0,
                                 atol=_logprob_tolerance(ref_sampling))


def test_a_released_row_takes_a_new_sequence_as_an_empty_one_would(model):
  """A row released mid-episode and given another prompt samples what a fresh sampler samples
  from that prompt, while the row beside it carries on as if nothing happened."""
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH, min_window=16)
  first, neighbour, second = _prompts([12, 7, 9], seed=5)
  keys = jax.random.split(jax.random.key(6), 3)

  def turns(state, rows):
    state, a = sampler.generate(state, keys[1], max_new_tokens=8, rows=rows)
    state = sampler.append(state, {row: [4, 5] for row in rows})
    state, b = sampler.generate(state, keys[2], max_new_tokens=6, rows=rows)
    return [(np.asarray(out.tokens[row]), np.asarray(out.logprobs[row])) for out in (a, b)
            for row in rows]

  state = sampler.append(sampler.empty(), {0: first, 1: neighbour})
  state, _ = sampler.generate(state, keys[0], max_new_tokens=10)
  state = sampler.release(state, [0])
  assert np.asarray(state.lengths)[0] == 0
  # Row 0's new prompt is prefilled beside row 1's next turn, in one call.
  state = sampler.append(state, {0: second, 1: [4, 5]})
  released = turns(state, [0, 1])
  fresh = turns(sampler.append(sampler.empty(), {0: second}), [0])
  continued = sampler.append(sampler.empty(), {0: first, 1: neighbour})
  continued, _ = sampler.generate(continued, keys[0], max_new_tokens=10)
  continued = turns(sampler.append(continued, {1: [4, 5]}), [1])
  for (tokens, logprobs), (ref_tokens,
                           ref_logprobs) in zip(released,
                                                [fresh[0], continued[0], fresh[1], continued[1]]):
    # Only the shapes XLA blocks its sums by differ: the reordering error model.
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(logprobs, ref_logprobs, rtol=0,
                               atol=_logprob_tolerance(ref_logprobs))
  with pytest.raises(ValueError, match="row 4 is outside"):
    sampler.release(state, [4])


def test_an_append_to_some_rows_computes_on_them_alone_and_leaves_the_others_bit_for_bit(model):
  """Appending to 1 of 4 rows (a quarter) runs `_prefill_rows` on that row alone: the other
  rows' cache bits, lengths and hidden states are untouched, the appended row holds what
  appending to every row in one full prefill gives it, and the program does about a quarter of
  the full one's work (XLA's count of its flops: a quarter of the matmuls and attention, plus
  reading the row's window out of the cache)."""
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH, min_window=16)
  prompts = _prompts([5, 9, 14, 3], seed=7)
  state = sampler.append(sampler.empty(), dict(enumerate(prompts)))
  state, _ = sampler.generate(state, jax.random.key(8), max_new_tokens=6)
  before = jax.device_get(state)
  lengths = np.asarray(before.cache.lengths)
  observation = [7, 8, 9, 10]
  full = jax.device_get(
      sampler.append(jax.tree.map(jnp.asarray, before),
                     {row: observation if row == 2 else [11] for row in range(BATCH)}))
  one = jax.device_get(sampler.append(jax.tree.map(jnp.asarray, before), {2: observation}))
  assert sampler._prefill_rows._cache_size() == 1 and sampler._prefill._cache_size() == 1
  others = [0, 1, 3]
  np.testing.assert_array_equal(one.cache.lengths, lengths + 4 * (np.arange(BATCH) == 2))
  np.testing.assert_array_equal(one.hidden[others], before.hidden[others])
  for bits, old_bits, full_bits in zip(one.cache.k + one.cache.v, before.cache.k + before.cache.v,
                                       full.cache.k + full.cache.v):
    np.testing.assert_array_equal(bits[others], old_bits[others])
    # The new keys and values: 4 rows or 1 change only how XLA blocks its sums.
    new, reference = (jax.lax.bitcast_convert_type(b[2, :, :lengths[2] + 4], jnp.float32)
                      for b in (bits, full_bits))
    np.testing.assert_allclose(new, reference, rtol=0,
                               atol=_logprob_tolerance(np.asarray(reference)))
  np.testing.assert_allclose(one.hidden[2], full.hidden[2], rtol=0,
                             atol=_logprob_tolerance(np.asarray(full.hidden[2])))

  def flops(program, *args, **kwargs):
    return program.lower(sampler.params, jax.tree.map(jnp.asarray, before), *args,
                         **kwargs).compile().cost_analysis()["flops"]

  window = sampler._window(lengths.max() + 4)
  tokens = np.zeros((BATCH, 16), np.int32)
  counts = np.full(BATCH, 4, np.int32)
  assert flops(sampler._prefill_rows, jnp.asarray(tokens[:1]), jnp.asarray(counts[:1]),
               jnp.asarray([2]),
               window=window) <= flops(sampler._prefill, jnp.asarray(tokens), jnp.asarray(counts),
                                       window=window) / (BATCH - 1)


def test_a_decode_of_few_rows_computes_on_them_alone_and_leaves_the_others_bit_for_bit(model):
  """With compact_decode a decode of 1 of 4 rows runs a 2-row program (the smallest): the other
  rows' cache bits (those they hold, for row 0, the program's idle row, whose padding write
  lands past its length; all of them for rows 1 and 3), lengths and hidden states are
  untouched, the row samples what the full-batch decode samples for it (tokens, log-probs,
  its cache and hidden state), and the program does at most 3/5 of the full one's work (XLA's
  count of its flops). 3 of 4 rows run on 3 rows, 4 on all."""
  compact = Sampler(model, cache_slots=SLOTS, max_batch=BATCH, min_window=16)
  full = Sampler(model, cache_slots=SLOTS, max_batch=BATCH, min_window=16, compact_decode=False)
  assert compact.compact_decode  # The default without a mesh.
  prompts = _prompts([5, 9, 14, 3], seed=11)
  before = jax.device_get(compact.append(compact.empty(), dict(enumerate(prompts))))
  key = jax.random.key(12)

  def decode(sampler, rows):
    state, out = sampler.generate(jax.tree.map(jnp.asarray, before), key, max_new_tokens=7,
                                  rows=rows)
    return jax.device_get((state, out))

  lowered = []

  def on_duration(event, duration, **kwargs):
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
      lowered.append(kwargs.get("fun_name"))

  monitoring.register_event_duration_secs_listener(on_duration)
  try:
    (one, one_out), (ref, ref_out) = decode(compact, [2]), decode(full, [2])
    # A program per bucket of rows, compiled the first time a call needs it: 2 rows, then the
    # full decode; 3 rows, then every row (compiled by `full` already: its own sampler).
    assert lowered.count("jit(_decode)") == 2
    decode(compact, [0, 1, 3])
    decode(compact, [1, 3])
    assert lowered.count("jit(_decode)") == 3
    decode(compact, range(BATCH))
    assert lowered.count("jit(_decode)") == 4
  finally:
    monitoring.unregister_event_duration_listener(on_duration)
  others = [0, 1, 3]
  np.testing.assert_array_equal(one.cache.lengths, ref.cache.lengths)
  np.testing.assert_array_equal(one.hidden[others], before.hidden[others])
  for bits, old_bits, ref_bits in zip(one.cache.k + one.cache.v, before.cache.k + before.cache.v,
                                      ref.cache.k + ref.cache.v):
    np.testing.assert_array_equal(bits[[1, 3]], old_bits[[1, 3]])
    held = before.cache.lengths[0]
    np.testing.assert_array_equal(bits[0, :, :held], old_bits[0, :, :held])
    # The new keys and values: 4 rows or 2 change only how XLA blocks its sums.
    new, reference = (jax.lax.bitcast_convert_type(b[2, :, :one.cache.lengths[2]], jnp.float32)
                      for b in (bits, ref_bits))
    np.testing.assert_allclose(new, reference, rtol=0,
                               atol=_logprob_tolerance(np.asarray(reference)))
  np.testing.assert_array_equal(one_out.tokens, ref_out.tokens)
  np.testing.assert_array_equal(one_out.lengths, ref_out.lengths)
  for name in ("logprobs", "sampling_logprobs", "hidden"):
    ours, theirs = (one, ref) if name == "hidden" else (one_out, ref_out)
    np.testing.assert_allclose(getattr(ours, name), getattr(theirs, name), rtol=0,
                               atol=_logprob_tolerance(np.asarray(getattr(theirs, name))))

  assert compact.decode_rows(np.arange(BATCH) == 2).tolist() == [2, 0]
  assert compact.decode_rows(np.arange(BATCH) != 1).tolist() == [0, 2, 3]
  assert compact.decode_rows(np.ones(BATCH, bool)).tolist() == list(range(BATCH))
  assert full.decode_rows(np.arange(BATCH) == 2).tolist() == list(range(BATCH))

  def flops(rows):
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(BATCH))
    zeros = jnp.zeros(BATCH, jnp.int32)
    return compact._decode.lower(compact.params, jax.tree.map(jnp.asarray,
                                                              before), keys, zeros, zeros + 7,
                                 jnp.zeros(sampling.MAX_STOP_IDS, jnp.int32), rows, width=8,
                                 sampling=SamplingParams()).compile().cost_analysis()["flops"]

  assert flops(jnp.asarray([2, 0])) <= 0.6 * flops(None)


def test_a_call_that_shrinks_stops_at_half_its_rows_and_a_smaller_one_finishes_them(model):
  """generate(shrink=True) on 4 rows whose budgets are 2, 3, 12 and 8 tokens ends after 3
  tokens, when only 2 rows are live (2 rows fit the smaller program); rows 2 and 3 come back
  unstopped and short of their budget, and a call on them alone, from their offsets, samples
  the rest of what one call samples; that call, on the smallest program, does not end when
  row 3 does. A sampler without compact decodes (one size of program) never ends early."""
  prompts = _prompts([4, 6, 3, 5], seed=13)
  key = jax.random.key(14)
  budgets = np.array([2, 3, 12, 8])
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  _, whole = jax.device_get(
      sampler.generate(sampler.start(prompts), key, max_new_tokens=12, budgets=budgets))
  np.testing.assert_array_equal(whole.lengths, budgets)
  state, first = sampler.generate(sampler.start(prompts), key, max_new_tokens=12, budgets=budgets,
                                  shrink=True)
  np.testing.assert_array_equal(first.lengths, [2, 3, 3, 3])
  assert not np.asarray(first.stopped).any()
  left = np.where(np.arange(BATCH) >= 2, budgets - 3, 0)
  state, rest = sampler.generate(state, key, max_new_tokens=12, rows=[2, 3], budgets=left,
                                 offsets=first.lengths, shrink=True)
  np.testing.assert_array_equal(rest.lengths, [0, 0, 9, 5])
  for name in ("tokens", "sampling_logprobs"):
    for row in (2, 3):
      ours = np.concatenate([
          np.asarray(getattr(first, name))[row, :3],
          np.asarray(getattr(rest, name))[row, :budgets[row] - 3]
      ])
      theirs = np.asarray(getattr(whole, name))[row, :budgets[row]]
      if name == "tokens":
        np.testing.assert_array_equal(ours, theirs)
      else:  # Finished in a 2-row program: other sums than the 4-row one's.
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=_logprob_tolerance(theirs))
  full = Sampler(model, cache_slots=SLOTS, max_batch=BATCH, compact_decode=False)
  _, out = full.generate(full.start(prompts), key, max_new_tokens=12, budgets=budgets, shrink=True)
  np.testing.assert_array_equal(out.lengths, budgets)


def test_the_layer_layout_is_kept_for_the_params_it_was_made_from(model):
  """With keep_layout the layers' weights are taken out of their stack once per params: calls
  with the same params reuse them, new params (an update's new arrays) replace them, and the
  tokens are those of a sampler that takes them out in every call."""
  kept = Sampler(model, cache_slots=SLOTS, max_batch=BATCH, keep_layout=True)
  per_call = Sampler(model, cache_slots=SLOTS, max_batch=BATCH, keep_layout=False)
  assert Sampler(model, cache_slots=SLOTS, max_batch=BATCH).keep_layout  # Tests run on CPU.
  updated = jax.tree.map(lambda x: x * 1.5, kept.params)
  prompts = _prompts([4, 7], seed=9)
  outputs = []
  for sampler in (kept, per_call):
    for params in (None, updated):
      state = sampler.start(prompts, params=params)
      _, out = sampler.generate(state, jax.random.key(1), max_new_tokens=5, params=params)
      outputs.append(out.token_lists())
  assert outputs[:2] == outputs[2:] and outputs[0] != outputs[1]
  assert kept._layout._cache_size() == 1 and per_call._layout._cache_size() == 0
  assert kept._kept is not None and kept._kept[0][0] is jax.tree.leaves(updated)[0]


def test_rows_stop_independently_on_stop_ids_budget_or_a_full_cache(model):
  sampler = Sampler(model, cache_slots=32, max_batch=BATCH, min_window=8)
  prompts = _prompts([4, 4, 28])
  _, greedy = sampler.generate(sampler.start(prompts), jax.random.key(0), max_new_tokens=8,
                               sampling=SamplingParams(temperature=0.0))
  row_0 = greedy.token_lists()[0]
  ends = next(i for i in range(1, 8) if row_0[i] not in row_0[:i])
  stop = row_0[ends]
  state, out = sampler.generate(sampler.start(prompts), jax.random.key(0), max_new_tokens=8,
                                sampling=SamplingParams(temperature=0.0), stop_ids=[stop])
  tokens = out.token_lists()
  # Row 0 ends on the first occurrence of the stop id, kept as its last token; row 1 runs to
  # its budget unless it meets the stop id; row 2 has 32 - 28 = 4 free slots.
  assert tokens[0] == row_0[:ends + 1] and bool(out.stopped[0])
  row_1 = greedy.token_lists()[1]
  expected = row_1.index(stop) + 1 if stop in row_1 else 8
  assert len(tokens[1]) == expected and bool(out.stopped[1]) == (stop in row_1)
  assert tokens[2] == greedy.token_lists()[2][:4] and not bool(out.stopped[2])
  assert np.asarray(state.lengths).tolist() == [4 + ends + 1, 4 + expected, 32, 0]
  # Padding past a row's length is zero.
  assert (np.asarray(out.tokens[0, ends + 1:]) == 0).all()
  assert (np.asarray(out.logprobs[0, ends + 1:]) == 0).all()
  with pytest.raises(ValueError, match="exceeds cache_slots=32"):
    sampler.append(state, {2: [1]})


def test_top_k_1_equals_greedy(model):
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  prompts = _prompts([5, 7, 2, 3])
  _, greedy = sampler.generate(sampler.start(prompts), jax.random.key(0), max_new_tokens=10,
                               sampling=SamplingParams(temperature=0.0))
  _, top1 = sampler.generate(sampler.start(prompts), jax.random.key(5), max_new_tokens=10,
                             sampling=SamplingParams(temperature=1.3, top_k=1))
  np.testing.assert_array_equal(np.asarray(top1.tokens), np.asarray(greedy.tokens))
  np.testing.assert_allclose(np.asarray(top1.logprobs), np.asarray(greedy.logprobs), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(top1.sampling_logprobs), 0.0)


def test_top_p_keeps_the_smallest_set_reaching_p():
  probs = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
  logits = jnp.log(jnp.asarray(probs, jnp.float32))[None]
  # Cumulative mass 0.5, 0.7, 0.85, 0.95, 1: p=0.45 keeps {0}; p=0.6 keeps {0, 1} (0.5 < 0.6
  # <= 0.7); p=0.75 keeps {0, 1, 2} (0.7 < 0.75 <= 0.85); p=1 keeps all.
  for top_p, kept in [(0.45, 1), (0.6, 2), (0.75, 3), (1.0, 5)]:
    q = np.exp(
        np.asarray(jax.nn.log_softmax(sampling_logits(logits, SamplingParams(top_p=top_p))))[0])
    np.testing.assert_allclose(q[:kept], probs[:kept] / probs[:kept].sum(), rtol=1e-5)
    np.testing.assert_array_equal(q[kept:], 0.0)
  # Draws follow the renormalised nucleus: with p=0.6, tokens 0 and 1 at 0.5/0.7 and 0.2/0.7.
  keys = jax.random.split(jax.random.key(0), 4000)
  tokens, _, sampling_logprobs = jax.jit(sample_tokens,
                                         static_argnums=2)(keys, jnp.repeat(logits, 4000, axis=0),
                                                           SamplingParams(top_p=0.6))
  counts = np.bincount(np.asarray(tokens), minlength=5)
  assert counts[2:].sum() == 0
  assert abs(counts[0] / 4000 - 0.5 / 0.7) < 0.03
  np.testing.assert_allclose(np.exp(np.asarray(sampling_logprobs)),
                             np.where(np.asarray(tokens) == 0, 0.5 / 0.7, 0.2 / 0.7), rtol=1e-5)


def test_temperature_scales_the_sampling_logprobs_only():
  logits = jnp.asarray([[2.0, 1.0, 0.0]])
  # T=2 samples from softmax([1, 0.5, 0]): log q(0) = 1 - log(e + e^0.5 + 1) = 1 - log(5.36700)
  # = -0.68026, while the model's log p(0) at temperature 1 stays 2 - log(e^2 + e + 1)
  # = 2 - log(11.1073) = -0.40761.
  q = jax.nn.log_softmax(sampling_logits(logits, SamplingParams(temperature=2.0)))
  assert float(q[0, 0]) == pytest.approx(-0.68026, abs=1e-5)
  keys = jax.random.split(jax.random.key(1), 64)
  tokens, logprobs, sampling_logprobs = sample_tokens(keys, jnp.repeat(logits, 64, axis=0),
                                                      SamplingParams(temperature=2.0))
  first = np.asarray(tokens) == 0
  assert first.any()
  np.testing.assert_allclose(np.asarray(logprobs)[first], -0.40761, atol=1e-5)
  np.testing.assert_allclose(np.asarray(sampling_logprobs)[first], -0.68026, atol=1e-5)


def test_sampling_params_are_validated():
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1.0)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="top_k"):
    SamplingParams(top_k=-2)


def test_compilations_are_bounded_over_multi_turn_episodes(model):
  sampler = Sampler(model, cache_slots=256, max_batch=BATCH, min_bucket=16, min_window=64)

  def episode(seed):
    rng = np.random.RandomState(seed)
    state = sampler.start(_prompts(rng.randint(1, 17, size=BATCH), seed))
    for turn in range(6):
      state, _ = sampler.generate(state, jax.random.key(turn), max_new_tokens=12 + turn,
                                  sampling=SamplingParams(temperature=1.0),
                                  stop_ids=[int(rng.randint(96))])
      state = sampler.append(state, {row: [3] * int(rng.randint(0, 15)) for row in range(BATCH)})
    return state

  for seed in range(3):
    episode(seed)
  # 3 episodes make 39 calls. Prompts and appends (1..16 tokens) share one length bucket,
  # max_new_tokens 12..17 three widths (12, 16, 24), and rows end below 16 + 6 * (17 + 14) = 202
  # slots, so in windows 64, 96, 128, 192 or 256: at most 5 prefill and 5 * 3 decode programs.
  # An append to one of the 4 rows runs on that row alone: one more program a window.
  assert sampler._prefill._cache_size() <= 5
  assert sampler._prefill_rows._cache_size() <= 5
  assert sampler._decode._cache_size() <= 15


@pytest.mark.slow
@pytest.mark.parametrize("instruction", [0, 19])
def test_sharded_sampler_matches_the_unsharded_one(model, instruction, monkeypatch):
  # With a 19-token instruction opening every prompt, 16 of its tokens are a shared prefix.
  monkeypatch.setattr(sampling, "SHARED_PREFIX_MULTIPLE", 8)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  sharded_model = weights.load_params(weights.abstract_model(CONFIG),
                                      weights.to_hf_state_dict(model), mesh)
  opening = _prompts([instruction], seed=7)[0]
  prompts = [opening + prompt for prompt in _prompts([4, 9, 2, 6, 5, 3, 7, 1])]
  assert sampling.shared_prefix(prompts) == (16 if instruction else 0)
  results = []
  for candidate, candidate_mesh in [(model, None), (sharded_model, mesh)]:
    sampler = Sampler(candidate, cache_slots=64, max_batch=8, mesh=candidate_mesh)
    state = sampler.start(prompts)
    state, first = sampler.generate(state, jax.random.key(0), max_new_tokens=6)
    state = sampler.append(state, {0: [1, 2], 5: [3]})
    state, second = sampler.generate(state, jax.random.key(1), max_new_tokens=6)
    results.append((state, first, second))
  (_, *reference), (state, *outputs) = results
  # Each layer's cache: rows over (data, fsdp) = 4 shards; CONFIG's 2 kv heads over tensor.
  expected = NamedSharding(mesh, P(("data", "fsdp"), "tensor", None, None))
  assert len(state.cache.k) == CONFIG.num_layers
  for layer in state.cache.k + state.cache.v:
    assert layer.sharding.is_equivalent_to(expected, 4)
  for out, ref in zip(outputs, reference):
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    # Sharded over 8 devices: partial sums added in another order (reordering error model).
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), rtol=0,
                               atol=_logprob_tolerance(np.asarray(ref.logprobs)))


def test_draws_follow_the_sampling_distribution():
  probs = np.array([0.5, 0.25, 0.15, 0.1, 0.0])
  logits = jnp.repeat(jnp.log(jnp.asarray(probs, jnp.float32))[None], 20000, axis=0)
  keys = jax.random.split(jax.random.key(7), 20000)
  tokens, _, _ = jax.jit(sample_tokens, static_argnums=2)(keys, logits, SamplingParams())
  frequencies = np.bincount(np.asarray(tokens), minlength=5) / 20000
  # Within 4 standard errors of each probability; the token of probability 0 never appears.
  np.testing.assert_array_less(np.abs(frequencies - probs),
                               4 * np.sqrt(probs * (1 - probs) / 20000) + 1e-12)


def test_bf16_sampler_matches_the_bf16_forward_pass(model):
  # bf16 weights, matmuls and cache: the path the benchmarks run (XLA:CPU has bf16 matmul
  # kernels only for some dot layouts, so this also proves every dot of the sampler has one).
  bf16_model = weights.load_params(
      weights.abstract_model(CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16),
      weights.to_hf_state_dict(model))
  sampler = Sampler(bf16_model, cache_slots=SLOTS, max_batch=BATCH)
  assert sampler.cache_dtype == jnp.bfloat16
  prompts = _prompts([7, 3])
  state = sampler.start(prompts)
  state, first = sampler.generate(state, jax.random.key(0), max_new_tokens=6)
  state = sampler.append(state, {0: [4, 5, 6], 1: [7]})
  state, second = sampler.generate(state, jax.random.key(1), max_new_tokens=6)
  forward = nnx.jit(lambda model, ids: jax.nn.log_softmax(model(ids)))
  for row in range(2):
    # Turn tokens are predicted from the position before each: prompt end, then append end.
    sequence = prompts[row] + first.token_lists()[row] + [[4, 5, 6], [7]][row]
    positions = [len(prompts[row]) - 1 + t for t in range(6)]
    positions += [len(sequence) - 1 + t for t in range(6)]
    sequence += second.token_lists()[row]
    logprobs = np.asarray(forward(bf16_model, jnp.asarray([sequence]))[0])
    ours = np.concatenate([np.asarray(first.logprobs[row]), np.asarray(second.logprobs[row])])
    reference = [logprobs[p, sequence[p + 1]] for p in positions]
    # Both round the same operands to bf16 and accumulate in f32 in different orders (cache vs
    # full sequence), so an activation whose f32 value lands on either side of a bf16 rounding
    # boundary differs by one bf16 ulp, 2^-8 of its size; a handful of such flips, damped by
    # the layers after them, move a log-prob by a fraction of an ulp of its own size.
    np.testing.assert_allclose(ours, reference, atol=2.0**-8 * np.abs(reference).max())


@pytest.mark.slow
def test_greedy_matches_transformers_on_smollm2(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import agentgym_jax  # pylint: disable=g-import-not-at-top
  model, tokenizer = agentgym_jax.load_model("smollm2-135m-instruct")
  weights.save_hf(model, tmp_path, dtype=jnp.float32)
  reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path,
                                                                dtype=torch.float32).eval()
  prompts = [
      tokenizer.chat.render([{"role": "user", "content": content}])
      for content in ("What is 2+2?", "Write a poem about the sea.", "List colors.")
  ]
  sampler = Sampler(model, cache_slots=256, max_batch=4)
  _, out = sampler.generate(sampler.start(prompts), jax.random.key(0), max_new_tokens=40,
                            sampling=SamplingParams(temperature=0.0))
  for row, prompt in enumerate(prompts):
    with torch.inference_mode():
      expected = reference.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                    pad_token_id=0, eos_token_id=None)[0, len(prompt):]
    assert out.token_lists()[row] == expected.tolist()


def test_inverse_cdf_draws_a_distribution_spread_over_many_blocks():
  # 1,000 tokens over four 256-weight blocks: a zero block, zeros between positive weights and
  # at the end (the padding of the last block is zero too).
  rng = np.random.default_rng(0)
  weights = rng.uniform(0.5, 1.5, 1000) * (rng.uniform(size=1000) < 0.3)
  weights[256:512] = 0.0
  weights[[3, 700, 999]] = [40.0, 25.0, 0.0]
  probs = weights / weights.sum()
  rows = 50_000
  logits = jnp.repeat(jnp.log(jnp.asarray(probs, jnp.float32))[None], rows, axis=0)
  tokens = np.asarray(
      jax.jit(sampling.inverse_cdf)(jax.random.split(jax.random.key(3), rows), logits))
  counts = np.bincount(tokens, minlength=1000)
  assert counts[probs == 0].sum() == 0
  # Chi-square over the tokens of positive weight (each expected over 5 times): with ~250
  # degrees of freedom the 99.99% quantile is under dof + 4.5 sqrt(2 dof).
  expected = rows * probs
  big = expected >= 5
  observed, expected = counts[big], expected[big]
  assert counts[~big].sum() == 0  # Every positive weight here is expected >= 5 times.
  dof = len(observed) - 1
  chi2 = np.sum((observed - expected)**2 / expected)
  assert chi2 < dof + 4.5 * np.sqrt(2 * dof), (chi2, dof)


def test_inverse_cdf_never_lands_on_a_zero_weight_at_the_ends_of_the_unit_interval():
  # Each row's positive weights sit mid-block with zeros after them, so a threshold past the
  # in-block sums (u near 1, or a rounding difference between the two levels) must stay on the
  # last positive weight.
  logits = np.full((3, 600), -np.inf, np.float32)
  logits[0, [10, 20]] = 0.0
  logits[1, [300, 301]] = [0.0, 5.0]
  logits[2, 599] = 0.0
  for u, expected in ((0.0, [10, 300, 599]), (1 - 2.0**-23, [20, 301, 599])):
    tokens = sampling.inverse_cdf_at(jnp.full((3,), u, jnp.float32), jnp.asarray(logits))
    assert np.asarray(tokens).tolist() == expected


def test_a_draw_takes_one_random_word_a_row_not_one_a_token():
  keys = jax.random.split(jax.random.key(0), 4)
  jaxpr = jax.make_jaxpr(sampling.inverse_cdf)(keys, jnp.zeros((4, 49152)))
  random_shapes = [
      v.aval.shape for eqn in jaxpr.jaxpr.eqns if "random" in eqn.primitive.name
      for v in eqn.outvars
  ]
  assert random_shapes and all(np.prod(shape, dtype=int) <= 4 for shape in random_shapes)


def _assert_greedy_as_if_alone(forward, prompts, out):
  """Row b's greedy tokens and their log-probs are those of plain forward passes over prompt b
  and the tokens it generated: the argmax continuation."""
  for row, prompt in enumerate(prompts):
    sequence = list(prompt)
    for _ in range(out.tokens.shape[1]):
      sequence.append(int(np.argmax(forward(sequence)[-1])))
    assert out.token_lists()[row] == sequence[len(prompt):]
    np.testing.assert_allclose(
        np.asarray(out.logprobs[row]),
        [forward(sequence[:t])[-1][sequence[t]] for t in range(len(prompt), len(sequence))], rtol=0,
        atol=_logprob_tolerance(np.asarray(out.logprobs)))


def _record_shared_prefills(sampler: Sampler) -> list[tuple]:
  """The (prefix, tokens) of each start's shared-prefix prefill, appended as the sampler runs."""
  calls, prefill = [], sampler._prefill_shared

  def record(params, state, prefix, tokens, *args, **kwargs):
    calls.append((prefix, tokens))
    return prefill(params, state, prefix, tokens, *args, **kwargs)

  sampler._prefill_shared = record
  return calls


def test_rows_sharing_a_prompt_prefill_it_once_and_continue_as_their_own(model, forward):
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  shared, other = _prompts([9, 4], seed=5)
  calls = _record_shared_prefills(sampler)
  state = sampler.start([shared, shared, other, shared])
  # Two distinct prompts, two rows prefilled.
  assert [tokens.shape[0] for _, tokens in calls] == [2]
  assert np.asarray(state.lengths).tolist() == [9, 9, 4, 9]
  # Each row then decodes as if it had been prefilled alone: greedy equals the argmax
  # continuation of plain forward passes over its own sequence.
  state, out = sampler.generate(state, jax.random.key(0), max_new_tokens=6,
                                sampling=SamplingParams(temperature=0.0))
  _assert_greedy_as_if_alone(forward, [shared, shared, other, shared], out)
  # Appending to rows that hold tokens takes the plain prefill, attending to what they hold.
  state = sampler.append(state, {0: [5, 6], 1: [5, 6]})
  assert len(calls) == 1 and np.asarray(state.lengths).tolist() == [17, 17, 10, 15]


def test_the_shared_prefix_is_the_common_prefix_short_of_a_token_cut_to_the_multiple(monkeypatch):
  monkeypatch.setattr(sampling, "SHARED_PREFIX_MULTIPLE", 1)
  assert sampling.shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == 2
  # Every prompt keeps a token of its own, even one that is another's prefix.
  assert sampling.shared_prefix([[1, 2, 3], [1, 2, 3, 4, 5]]) == 2
  assert sampling.shared_prefix([[7, 1], [8, 1]]) == 0
  monkeypatch.setattr(sampling, "SHARED_PREFIX_MULTIPLE", 4)
  common = list(range(10, 21))  # 11 common tokens: 8 are shared.
  assert sampling.shared_prefix([common + [1, 2], common + [3], common + [4, 5, 6]]) == 8


def test_prompts_prefill_their_common_prefix_once_and_decode_as_if_alone(
    model, forward, monkeypatch):
  monkeypatch.setattr(sampling, "SHARED_PREFIX_MULTIPLE", 8)
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH, min_bucket=4)
  instruction = _prompts([19], seed=7)[0]
  prompts = [instruction + tail for tail in _prompts([5, 9, 1], seed=8)]
  prompts.append(prompts[1])
  calls = _record_shared_prefills(sampler)
  state = sampler.start(prompts)
  # 16 of the 19 common tokens once, then the three distinct rests (3 + 5, 3 + 9, 3 + 1 tokens).
  assert [(prefix.shape, tokens.shape) for prefix, tokens in calls] == [((16,), (3, 12))]
  assert np.asarray(state.lengths).tolist() == [24, 28, 20, 28]
  state, out = sampler.generate(state, jax.random.key(0), max_new_tokens=6,
                                sampling=SamplingParams(temperature=0.0))
  _assert_greedy_as_if_alone(forward, prompts, out)


def test_a_shared_start_leaves_rows_not_given_a_prompt_untouched(model):
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  state = sampler.start(_prompts([3, 3, 5], seed=1))
  before = jax.device_get((state.cache.k, state.cache.lengths, state.hidden))
  prompt = _prompts([6], seed=2)[0]
  # Row 3 is empty: a shared append there copies nothing into rows 0-2.
  state = sampler.append(state, {3: prompt})
  after = jax.device_get((state.cache.k, state.cache.lengths, state.hidden))
  for layer_after, layer_before in zip(after[0], before[0]):
    np.testing.assert_array_equal(layer_after[:3], layer_before[:3])
  np.testing.assert_array_equal(after[2][:3], before[2][:3])
  assert after[1].tolist() == [3, 3, 5, 6]


def test_a_prompt_beside_observations_is_prefilled_apart_and_decodes_as_if_alone(model):
  """A refilled row's 40-token prompt appended beside the other rows' 2-token observations:
  the prompt is prefilled in a call of its own and the observations at their own width, not
  padded to the prompt's; every row then decodes what it decodes when its tokens are appended
  alone (greedy: the same tokens, log-probs within the reordering model)."""
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  greedy = dict(max_new_tokens=6, sampling=SamplingParams(temperature=0.0))
  state = sampler.start(_prompts([5, 9, 3, 4], seed=3))
  state, _ = sampler.generate(state, jax.random.key(2), max_new_tokens=4)
  before = jax.device_get(sampler.release(state, [1]))
  prompt = _prompts([40], seed=4)[0]
  observations = {0: [7, 8], 2: [9, 10], 3: [11, 12]}
  widths, prefill = [], sampler._prefill

  def recorded(params, state, tokens, *args, **kwargs):
    widths.append(tokens.shape[1])
    return prefill(params, state, tokens, *args, **kwargs)

  sampler._prefill = recorded
  state = sampler.append(jax.tree.map(jnp.asarray, before), {1: prompt, **observations})
  assert bucket(2, sampler.min_bucket) < bucket(40, sampler.min_bucket)
  assert widths == [bucket(2, sampler.min_bucket)]  # The observations' call.
  _, both = sampler.generate(state, jax.random.key(0), **greedy)
  _, others = sampler.generate(sampler.append(jax.tree.map(jnp.asarray, before), observations),
                               jax.random.key(0), **greedy)
  _, alone = sampler.generate(sampler.start([prompt]), jax.random.key(0), **greedy)
  for row, reference in [(0, others), (1, alone), (2, others), (3, others)]:
    reference_row = 0 if reference is alone else row
    np.testing.assert_array_equal(both.tokens[row], reference.tokens[reference_row])
    np.testing.assert_allclose(both.logprobs[row], reference.logprobs[reference_row], rtol=0,
                               atol=_logprob_tolerance(np.asarray(reference.logprobs)))


@pytest.mark.slow
def test_a_matmul_copy_samples_what_the_parameters_sample():
  """A pod host's sampler reads a local copy whose matmul weights are in the matmul dtype
  (multihost.Processes.sampler_copy): with bf16 matmuls it samples the same tokens with the
  same log-probs over two turns, the f32 biases and norms beside bf16 projections included."""
  config = ModelConfig(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
  model = nnx.jit(lambda: Decoder(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))()
  model.layers.q_bias[...] = jax.random.normal(jax.random.key(1), model.layers.q_bias.shape)
  params = nnx.state(model)
  copy = decoder.matmul_copy(params, jnp.bfloat16)
  assert copy["layers"]["q_proj"].dtype == jnp.bfloat16
  assert copy["layers"]["q_bias"].dtype == jnp.float32
  sampler = Sampler(model, cache_slots=SLOTS, max_batch=BATCH)
  sampling = dict(max_new_tokens=8, sampling=SamplingParams(temperature=0.9, top_k=40))

  def episode(params):
    state = sampler.start(_prompts([5, 9, 3]), params)
    state, first = sampler.generate(state, jax.random.key(0), params=params, **sampling)
    state = sampler.append(state, {0: [4, 5], 1: [6], 2: [7, 8, 9]}, params)
    _, second = sampler.generate(state, jax.random.key(1), params=params, **sampling)
    return [np.asarray(x) for out in (first, second) for x in (out.tokens, out.logprobs)]

  for ours, theirs in zip(episode(copy), episode(params)):
    np.testing.assert_array_equal(ours, theirs)


def test_a_draw_at_temperature_1_returns_the_model_log_prob_from_its_own_sums():
  """At temperature 1 with no top-k or top-p, log p and log q are the token's log-softmax, the
  normaliser taken from the draw's block sums. Error model: the two-level f32 sum of 49,152
  weights in [0, 1] is off by at most ~(256 + 192) ulp relative, which the log carries as an
  absolute error of ~448 * 6e-8 = 2.7e-5 against the exact (float64) log-softmax."""
  logits = 4.0 * jax.random.normal(jax.random.key(0), (8, 49152))
  keys = jax.random.split(jax.random.key(1), 8)
  tokens, logprobs, sampling_logprobs = jax.jit(sample_tokens, static_argnums=2)(keys, logits,
                                                                                 SamplingParams())
  exact = np.asarray(logits, np.float64)
  peak = exact.max(axis=1)
  normaliser = peak + np.log(np.exp(exact - peak[:, None]).sum(axis=1))
  expected = exact[np.arange(8), np.asarray(tokens)] - normaliser
  np.testing.assert_allclose(np.asarray(logprobs), expected, atol=6e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(logprobs), np.asarray(sampling_logprobs))
