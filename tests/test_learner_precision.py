"""The learner's numerics on the embedded SmolLM2 and a real batch (TextCraft demonstrations):
a bf16 gradient against the f32 one within tests/tolerances.py's bf16 error model, whatever the
rows a pass holds; a step's first minibatch at a ratio of exactly 1; one update that moves the
trajectories the way their advantages point."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import demonstrations, learner, load_model
from agentgym_jax.batch import Batch
from agentgym_jax.offline_data import tokenize_conversation
from environments import base

import tolerances

ROWS = 8
GROUP = 4
# Outcomes of the rows, groups of 4: one or three successes a group, so every advantage is +-.
REWARDS = np.array([1, 0, 0, 0, 1, 1, 0, 1], np.float32)
gradients = jax.jit(learner._gradients, static_argnums=4)


@functools.cache
def _smollm2():
  return load_model("smollm2-135m-instruct", dtype=jnp.float32, param_dtype=jnp.float32,
                    remat="full", attention="flash")


def _policy(num_layers: int, dtype) -> tuple[nnx.GraphDef, nnx.State]:
  """SmolLM2's embedding, head and its first `num_layers` layers, matmuls in `dtype`."""
  model, _ = _smollm2()
  graphdef, params = nnx.split(model)
  params = jax.tree.map(lambda x: x, params)
  params["layers"] = jax.tree.map(lambda x: x[:num_layers], params["layers"])
  config = dataclasses.replace(model.config, num_layers=num_layers)
  abstract = nnx.eval_shape(lambda: type(model)
                            (config, dtype=dtype, remat=model.remat, attention=model.attention))
  return nnx.split(abstract)[0], params


@functools.cache
def _batch(length: int) -> Batch:
  """The last `length` tokens of the oracle's demonstrations of ROWS TextCraft train goals in the
  model's chat layout (the first rows' replies and observations, the prompt's end before them;
  a shorter conversation whole), trained on the replies, with REWARDS as outcomes."""
  env = base.make("textcraft", max_depth=2)
  try:
    demos = demonstrations.demonstrate_tasks(env, list(env.task_ids("train"))[:ROWS]).demos
  finally:
    env.close()
  chat = _smollm2()[1].chat_template()
  rows = [tokenize_conversation(chat, demo["messages"]) for demo in demos]
  # Right-padded (token 0, outside the loss) where a whole conversation is shorter.
  pad = lambda x, dtype: np.pad(np.asarray(x[-length:], dtype), (0, max(0, length - len(x))))
  tokens = np.stack([pad(t, np.int32) for t, _ in rows])
  loss_mask = np.stack([pad(m, np.float32) for _, m in rows])
  return Batch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(loss_mask),
               sampler_logprobs=jnp.zeros(tokens.shape, jnp.float32), rewards=jnp.asarray(REWARDS),
               group_ids=jnp.asarray(np.arange(ROWS) // GROUP, jnp.int32))


def _gradient(num_layers: int, dtype, batch: Batch, micro_batch_rows: int):
  """(flat gradient, metrics) of GRPO's loss on `batch` at the experience's parameters."""
  graphdef, params = _policy(num_layers, dtype)
  loss = learner.LossConfig(micro_batch_rows=micro_batch_rows, logprob_chunk=256)
  experience, _ = learner.compute_experience(learner.Networks(graphdef), (params, None), None,
                                             batch, loss=loss, num_groups=ROWS // GROUP)
  grads, metrics = gradients((params, None), learner.Networks(graphdef), batch, experience, loss,
                             None, jnp.asarray(True))
  flat = np.concatenate([np.ravel(g).astype(np.float64) for g in jax.tree.leaves(grads[0])])
  return flat, {k: float(v) for k, v in metrics.items()}


def _assert_bf16_gradient_agrees(num_layers: int, length: int) -> None:
  """The bf16 gradient within tolerances.bf16_gradient of the f32 one, in passes of 8, 4 and 2
  rows; every pass, f32 or bf16, at a ratio of exactly 1 (the first minibatch of a step)."""
  batch = _batch(length)
  reference, metrics = _gradient(num_layers, jnp.float32, batch, 0)
  _assert_on_policy(metrics)
  eps = tolerances.bf16_gradient(num_layers)
  results = {}
  for micro_batch_rows in (0, 4, 2):
    got, metrics = _gradient(num_layers, jnp.bfloat16, batch, micro_batch_rows)
    _assert_on_policy(metrics)
    cosine = got @ reference / (np.linalg.norm(got) * np.linalg.norm(reference))
    results[micro_batch_rows] = (cosine, np.linalg.norm(got) / np.linalg.norm(reference))
  report = ", ".join(
      f"micro_batch_rows={m}: cosine {c:.5f}, norm x{n:.4f}" for m, (c, n) in results.items())
  print(f"bf16 gradient vs f32, {num_layers} layers, {ROWS} x {length} tokens, eps {eps:.4f}: "
        f"{report}")
  for cosine, norm_ratio in results.values():
    assert cosine >= 1 - eps**2 / 2, report
    assert abs(norm_ratio - 1) <= eps, report


def _assert_on_policy(metrics: dict[str, float]) -> None:
  assert metrics["policy/ratio_max"] == 1.0
  assert metrics["policy/ratio_mean"] == 1.0
  assert metrics["policy/approx_kl"] == 0.0
  assert metrics["policy/clip_fraction"] == 0.0


@pytest.mark.slow
def test_a_bf16_gradient_agrees_with_f32_and_a_fresh_minibatchs_ratio_is_exactly_1():
  _assert_bf16_gradient_agrees(num_layers=2, length=128)


@pytest.mark.slow
def test_the_whole_models_bf16_gradient_agrees_with_f32_on_whole_conversations():
  _assert_bf16_gradient_agrees(num_layers=30, length=1024)


@pytest.mark.slow
def test_one_update_moves_each_outcome_the_way_of_its_advantage():
  """After one AdamW step on GRPO's loss, the summed log-prob of the replies rises on average
  over the rows with a positive advantage and falls over the others, and the surrogate loss
  falls. On the whole model: cut to its first layers it is no language model, and there one
  step lowered every reply's log-prob."""
  graphdef, params = _policy(30, jnp.bfloat16)
  batch = _batch(128)
  loss = learner.LossConfig(logprob_chunk=256)
  experience, _ = learner.compute_experience(learner.Networks(graphdef), (params, None), None,
                                             batch, loss=loss, num_groups=ROWS // GROUP)
  optimizer = learner.make_optimizer(1e-5)
  state = learner.UpdateState((params, None), optimizer.init((params, None)))
  before = jax.tree.map(jnp.copy, params)
  state, metrics = jax.jit(learner.update_step, static_argnames=learner.UPDATE_STATIC_ARGNAMES)(
      learner.Networks(graphdef), state, batch, experience, optimizer=optimizer, loss=loss,
      on_policy=jnp.asarray(True))
  params = state.trainable[0]
  logprobs = lambda p: learner.token_logprobs(graphdef, p, batch, loss)[0]
  mask = batch.loss_mask[:, 1:]
  moved = np.asarray(jnp.sum((logprobs(params) - logprobs(before)) * mask, axis=1))
  advantage = np.asarray(jnp.sum(experience.advantages * mask, axis=1) / jnp.sum(mask, axis=1))
  assert moved[advantage > 0].mean() > 0 > moved[advantage < 0].mean(), (moved, advantage)
  _, after = gradients((params, None), learner.Networks(graphdef), batch, experience, loss)
  assert float(after["policy/loss"]) < float(metrics["policy/loss"])
