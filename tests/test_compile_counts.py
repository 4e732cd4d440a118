"""Compilations over a training run with a growing horizon: after warm-up, nothing recompiles.

Every jitted function that compiles lowers its jaxpr to an MLIR module first, and jax reports
each lowering as a "/jax/core/compile/jaxpr_to_mlir_module_duration" event naming the function.
A lowering happens exactly when a call misses the in-process jit cache (a persistent compilation
cache hit still lowers), so counting these events per training step counts the programs each
step adds: the learner's compute_experience and update_step, the sampler's _prefill_shared
(prompts), _prefill and _prefill_rows (continuations) and _decode, and every small eager op
(jnp.stack, indexing, ...) alike.
"""

import collections

import jax
import numpy as np
import pytest
from jax import monitoring

from agentgym_jax import metrics, rollout, sharding, trainer
from agentgym_jax import settings as settings_lib
from agentgym_jax.sampling import Sampler, bucket
from rl_helpers import echo_config

LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def _fun_name(name: str) -> str:
  """'jit(_prefill)' -> '_prefill'."""
  return name[len("jit("):-1] if name.startswith("jit(") and name.endswith(")") else name


def _row_buckets(sampler: Sampler) -> set[int]:
  """The row counts a program of `sampler` may run on: bucket(n) for n of 1..max_batch."""
  return {bucket(n, 1, sampler.max_batch) for n in range(1, sampler.max_batch + 1)}


def _count_lowerings(c, workdir, monkeypatch):
  """Trains `c` on one device in `workdir`, counting the programs each step lowers; returns
  (history, a Counter of lowered function names per step, the samplers made, the batches
  packed)."""
  monkeypatch.setattr(
      sharding, "make_mesh", lambda *a, **k: sharding.Mesh(
          np.asarray(jax.devices()[:1]).reshape(1, 1, 1), sharding.MESH_AXES))
  lowered: list[str] = []

  def on_duration(event, duration, **kwargs):
    del duration
    if event == LOWERING_EVENT:
      lowered.append(_fun_name(kwargs.get("fun_name", "")))

  # The per-step snapshot is taken when the trainer writes the step's metrics row, after its
  # rollout, experience and update (and the metrics' own fetch) have run.
  per_step: list[collections.Counter] = []
  seen = [0]
  write = metrics.MetricsWriter.write

  def write_and_count(self, step, values):
    write(self, step, values)
    per_step.append(collections.Counter(lowered[seen[0]:]))
    seen[0] = len(lowered)

  samplers: list[Sampler] = []

  class RecordedSampler(Sampler):

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      samplers.append(self)

  monkeypatch.setattr(metrics.MetricsWriter, "write", write_and_count)
  batches = []
  pack = rollout.pack
  monkeypatch.setattr(rollout, "pack", lambda *a, **k: batches.append(pack(*a, **k)) or batches[-1])
  monkeypatch.setattr(settings_lib, "Sampler", RecordedSampler)
  monitoring.register_event_duration_secs_listener(on_duration)
  try:
    history = trainer.train(c, workdir)
  finally:
    monitoring.unregister_event_duration_listener(on_duration)
  return history, per_step, samplers, batches


@pytest.mark.slow
@pytest.mark.parametrize("shared_prompts", [True, False])
def test_horizon_stages_compile_only_the_first_continuation_prefill(shared_prompts, checkpoint_dir,
                                                                    tmp_path, monkeypatch):
  c = echo_config(checkpoint_dir, steps=5)
  c.env.options.turns = 3
  c.horizon.kind = "stepwise"
  c.horizon.caps = (1, 2, 3)
  c.horizon.every = 1
  # 3 x 8 rows: a batch shape no other test compiles, so the warm-up really compiles the learner.
  c.rollout.tasks_per_step = 3
  c.algorithm.shared_prompts = shared_prompts
  # Shared prompts keep a task's samples in one minibatch: 3 minibatches of one task each.
  c.algorithm.num_minibatches = 3 if shared_prompts else 2
  history, per_step, samplers, batches = _count_lowerings(c, tmp_path, monkeypatch)

  assert [h["horizon_cap"] for h in history] == [1, 2, 3, 3, 3]
  assert [b.shared is not None for b in batches] == [shared_prompts] * 5
  # Multi-turn episodes really happened in the later stages (the policy is random).
  assert max(h["turns"] for h in history[1:]) > 1
  warm_up, first_cap2, first_cap3, *repeats = per_step
  assert {"_prefill_shared", "_decode", "compute_experience", "update_step"} <= set(warm_up)
  # The only new programs once turns follow turns: the prefill appending an observation to rows
  # that hold tokens (the prompts went through the shared prefill), on all rows, or on a
  # quarter of them when at most a quarter continue (`_prefill_rows`), and the decode of the
  # few rows still playing at the end of a step (`Sampler.decode_rows`: one program per bucket
  # of rows); each is compiled the first time a step needs it, whichever stage that is. The
  # attention window cannot grow: it is capped at cache_slots = max_context = 64, below
  # min_window. Packed batches stay at the minimum length bucket (128 >= 64), and shared-prompt
  # rows at theirs (8 samples x 128 >= 8 x 64, whatever the groups' prompts and
  # continuations), so the learner's shapes never change.
  continuations = sum([first_cap2, first_cap3, *repeats], collections.Counter())
  assert first_cap2 and set(continuations) <= {"_prefill", "_prefill_rows", "_decode"}, per_step
  assert max(continuations.values()) <= len(_row_buckets(samplers[0])), continuations
  # The same count from the jit caches: nothing compiled twice. A prompt prefill, at most two
  # continuation prefills, a decode per bucket of rows.
  (sampler,) = samplers
  programs = sum(per_step, collections.Counter())
  assert sampler._prefill_shared._cache_size() == 1
  assert sampler._decode._cache_size() == programs["_decode"] <= len(_row_buckets(sampler))
  assert (sampler._prefill._cache_size() + sampler._prefill_rows._cache_size() ==
          programs["_prefill"] + programs["_prefill_rows"] <= 2)


@pytest.mark.slow
def test_partial_rollouts_compile_only_re_prefill_buckets_after_the_warm_up(
    checkpoint_dir, tmp_path, monkeypatch):
  # Asynchronous steps whose live rows move to the next policy after every decode call: the
  # release of the rows (Sampler.release) is one program whatever their count, and their
  # re-prefill under the new policy is the prompt prefill at a (rows, width) bucket, of which
  # there are few.
  c = echo_config(checkpoint_dir, steps=5)
  c.rollout.max_staleness = 1
  c.rollout.partial_rollouts = 1
  c.algorithm.rollout_correction = "decoupled"
  history, per_step, samplers, _ = _count_lowerings(c, tmp_path, monkeypatch)
  assert [h["rollout/turn_staleness"] < h["rollout/staleness"] for h in history[1:]] == [True] * 4
  # The first re-prefill happens in a rollout played during an earlier step's update, so its
  # programs may land in the warm-up's count or a later one's; so may the first observation
  # appended to all rows or to a quarter of them (`_prefill`, `_prefill_rows`), one program
  # each at the one window and width of these episodes, and the decode of a bucket of rows.
  later = sum(per_step[1:], collections.Counter())
  assert set(later) <= {
      "_prefill_shared", "stage", "_where", "_prefill", "_prefill_rows", "_decode"
  }, later
  (sampler,) = samplers
  assert sampler._prefill._cache_size() <= 1 and sampler._prefill_rows._cache_size() <= 1
  assert sum(per_step, collections.Counter())["_where"] == 1  # Every release, one program.
  # The prompt prefill's and the decode's programs: at most one per bucket of rows (the width
  # stays at the minimum bucket, as max_context = 64 is below it).
  assert sampler._prefill_shared._cache_size() <= len(_row_buckets(sampler))
  assert sampler._decode._cache_size() <= len(_row_buckets(sampler))


@pytest.mark.slow
def test_replies_in_chunks_on_refilled_rows_compile_nothing_after_the_warm_up(
    checkpoint_dir, tmp_path, monkeypatch):
  # One token a decode call over 3-token replies, on 16 refilled rows for 64 episodes: rows
  # leave the decode for their env steps and rejoin, and take new episodes, in counts and at
  # moments that vary call by call (with timing). The decode is one program per bucket of the
  # rows it runs; an append is a prefill at one of the few buckets of its widest entry (a
  # refilled prompt beside the others' observations, or observations alone), on all rows or a
  # quarter of them. Each is compiled the first time a call needs it.
  c = echo_config(checkpoint_dir, steps=4)
  c.env.options.turns = 3
  c.rollout.max_new_tokens = 3
  c.rollout.decode_chunk = 1
  c.rollout.wave_rows = 16
  c.horizon.turns = 3
  history, per_step, samplers, _ = _count_lowerings(c, tmp_path, monkeypatch)
  assert max(h["turns"] for h in history) > 1
  later = sum(per_step[1:], collections.Counter())
  assert set(later) <= {"_prefill_shared", "_prefill", "_prefill_rows", "_decode"}, later
  (sampler,) = samplers
  widths = {bucket(n, sampler.min_bucket) for n in range(1, sampler.cache_slots + 1)}
  assert sampler._decode._cache_size() <= len(_row_buckets(sampler))
  assert sampler._prefill._cache_size() <= len(widths)
  assert sampler._prefill_rows._cache_size() <= len(widths)
