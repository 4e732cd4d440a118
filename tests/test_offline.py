"""SFT and DPO end to end on a tiny model: learning, the loss mask, exact resume, the launcher."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import checkpoint, config as config_lib, demonstrations, learner, metrics
from agentgym_jax import settings as settings_lib
from agentgym_jax import state as state_lib
from agentgym_jax import offline, offline_data, sharding
from agentgym_jax.models import load_model
from environments import base
from rl_helpers import conversation, jsonl_file, launch_train
from test_configs import load

# Replies that depend on the prompt, of different lengths, one with two turns.
DEMOS = [
    {"messages": conversation("1 0", "0 1 1")},
    {"messages": conversation("0 0", "1")},
    {"messages": conversation("1 1", "0 0", "1", "1 0 1")},
    {"messages": conversation("0 1", "1 1 0 0")},
]


def _record(task_id, prompt, reply, success):
  return {
      "task_id": task_id, "env": "echo", "messages": conversation(prompt, reply),
      "reward": float(success), "success": success, "num_turns": 1
  }


# Per task (prompt, a preferred (successful) reply, a rejected one).
PAIRS = [("1 0", "0 1", "1 1"), ("0 0", "1", "0"), ("1 1", "0 0 1", "1 0 0"), ("0 1", "1 0", "0 1")]
PAIR_RECORDS = [
    _record(task_id, prompt, reply, success)
    for task_id, (prompt, chosen, rejected) in enumerate(PAIRS)
    for reply, success in ((chosen, True), (rejected, False))
]


@pytest.fixture(scope="module")
def tiny_model(checkpoint_dir):
  return load_model(checkpoint_dir)


def offline_config(checkpoint_dir, data_path, mode="sft", steps=40):
  c = config_lib.base_config()
  c.mode = mode
  c.steps = steps
  c.model.name = checkpoint_dir
  c.model.dtype = "float32"
  c.model.remat = "none"
  c.env.name = "echo"
  c.data.path = str(data_path)
  # Two conversations of at most 32 tokens per step: every SFT test below runs the same
  # program, compiled once by this file's first test.
  c.data.batch_size = 2
  c.data.max_length = 32
  c.algorithm.logprob_chunk = 16
  c.optim.learning_rate = 3e-3
  c.optim.weight_decay = 0.0
  config_lib.quiet(c)
  return c


def _trained_params(c, workdir):
  """The policy parameters of the newest checkpoint in `workdir`, restored as a resume does."""
  model, _ = load_model(c.model.name)
  _, params = nnx.split(model)
  template = state_lib.RunState(
      params, None,
      settings_lib.Settings.from_config(c).update.optimizer.init(params)).tree()
  with checkpoint.Checkpointer(pathlib.Path(workdir) / "checkpoints") as checkpointer:
    restored, _ = checkpointer.restore(template)
  return restored["params"]


@pytest.mark.slow
def test_sft_learns_the_demonstrations_and_greedy_decoding_reproduces_them(
    checkpoint_dir, tiny_model, tmp_path, single_device):
  c = offline_config(checkpoint_dir, jsonl_file(tmp_path / "demos.jsonl", DEMOS), steps=40)
  c.checkpoint.every = 40
  history = offline.train_offline(c, tmp_path / "run")
  losses = [h["loss"] for h in history]
  # A random model over the 9-token vocabulary starts near ln 9 = 2.2 nats per token.
  assert losses[0] > 1.5, losses
  assert np.mean(losses[-2:]) < 0.05 * losses[0], losses  # The last epoch's two batches.
  # Reply tokens with their im_end: "0 1 1" 5 + 1, "1" 1 + 1, "0 0" and "1 0 1" 4 + 6,
  # "1 1 0 0" 7 + 1; each epoch's two batches hold all 26.
  assert history[-1]["trained_tokens"] + history[-2]["trained_tokens"] == 26
  assert history[-1]["tokens_per_s"] > 0 and history[-1]["epoch"] == 20

  # Greedy decoding reproduces a reply iff, fed the demonstration, the argmax at every reply
  # position is the demonstrated next token (the closing <|im_end|> included).
  _, tokenizer = tiny_model
  graphdef, _ = nnx.split(tiny_model[0])
  model = nnx.merge(graphdef, _trained_params(c, tmp_path / "run"))
  for demo in DEMOS:
    tokens, loss_mask = offline_data.tokenize_conversation(tokenizer.chat, demo["messages"])
    tokens, trained = np.asarray(tokens), np.asarray(loss_mask[1:]) == 1
    greedy = np.asarray(jnp.argmax(model(tokens[None, :-1])[0], axis=-1))
    np.testing.assert_array_equal(greedy[trained], tokens[1:][trained])


def test_sft_loss_is_the_token_mean_over_reply_tokens_only(checkpoint_dir, tiny_model):
  model, tokenizer = tiny_model
  graphdef, params = nnx.split(model)
  batches = offline_data.sft_batches(DEMOS[:2], tokenizer.chat, batch_size=2, max_length=32)
  batch = batches.batch(0)
  loss_config = learner.LossConfig(logprob_chunk=8)
  loss, out = learner.sft_objective(params, learner.Networks(graphdef), batch, loss_config)

  # Reference from full logits: -log p of each next token, averaged over the reply tokens.
  # The rows train 2 and 6 tokens: a token mean weighs the 8 tokens equally, where a mean of
  # the two per-row means would weigh the short reply's tokens 3x as much.
  log_probs = jax.nn.log_softmax(model(batch.tokens[:, :-1]), axis=-1)
  nll = -np.take_along_axis(np.asarray(log_probs), batch.tokens[:, 1:, None], axis=-1)[..., 0]
  mask = batch.loss_mask[:, 1:]
  assert mask.sum(axis=1).tolist() == [2.0, 6.0]
  np.testing.assert_allclose(loss, (nll * mask).sum() / mask.sum(), rtol=1e-5)
  assert out["trained_tokens"] == 8
  row_means = (nll * mask).sum(axis=1) / mask.sum(axis=1)
  assert abs(float(loss) - row_means.mean()) > 1e-3

  # An observation after the last reply (tokens with mask 0 in place of padding) is only ever a
  # target, never the context of a reply token: the loss must not see it.
  observation = tokenizer.chat.continuation_ids("user", "1 0 1 1")
  perturbed = batch.tokens.copy()
  for row in range(2):
    end = int(np.nonzero(batch.loss_mask[row])[0][-1]) + 1
    written = observation[:perturbed.shape[1] - end]
    perturbed[row, end:end + len(written)] = written
  assert not np.array_equal(perturbed, batch.tokens)
  loss_of = lambda **changes: learner.sft_objective(params, learner.Networks(graphdef),
                                                    batch.replace(**changes), loss_config)[0]
  np.testing.assert_allclose(loss_of(tokens=perturbed), loss, rtol=1e-6)
  # ... though a loss over every position would.
  unmasked = np.ones_like(batch.loss_mask)
  loss_all = loss_of(loss_mask=unmasked)
  assert abs(float(loss_of(tokens=perturbed, loss_mask=unmasked)) - float(loss_all)) > 1e-3


def test_sft_on_echo_demonstrations_solves_the_test_split(checkpoint_dir, tmp_path, single_device):
  env = base.make("echo", turns=2)
  # The expert answers each turn with the symbol it is shown.
  demos = demonstrations.demonstrate_tasks(
      env,
      env.task_ids("train")[:16], source="echo",
      expert=lambda env, task_id: list(env.task_info(task_id)["sequence"])).demos
  c = offline_config(checkpoint_dir, jsonl_file(tmp_path / "demos.jsonl", demos), steps=50)
  c.data.batch_size = 8
  c.data.max_length = 64
  c.env.options.turns = 2
  c.rollout.tasks_per_step = 4
  c.rollout.samples_per_task = 2
  c.rollout.max_new_tokens = 2
  c.rollout.max_context = 64
  config_lib.fixed_horizon(2)(c)
  c.eval.every = 50  # Greedy, on the first 16 test tasks, after the last step.
  c.eval.max_tasks = 16
  history = offline.train_offline(c, tmp_path / "run")
  # A random policy answers both turns right a few percent of the time (tests/test_trainer.py).
  assert history[-1]["eval/success"] == 1.0, history[-1]
  assert "eval/success" not in history[-2]


def test_update_compiles_once_per_batch_length(checkpoint_dir, tmp_path):
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  model, tokenizer = load_model(checkpoint_dir, mesh=mesh)
  graphdef, params = nnx.split(model)
  c = offline_config(checkpoint_dir, tmp_path)
  init, update = offline.make_update(settings_lib.Settings.from_config(c), params, mesh)
  state = learner.UpdateState(params, init(params))
  batches = offline_data.sft_batches(DEMOS, tokenizer.chat, c.data.batch_size, c.data.max_length)
  for step in range(3):
    state, _ = update(learner.Networks(graphdef), state, jax.device_put(batches.batch(step)), None)
  # The state comes back with the shardings it went in with, so later steps reuse the first
  # step's program (left to XLA, the returned state's shardings differ and step 2 recompiles).
  assert update._cache_size() == 1


def test_dpo_prefers_the_chosen_replies(checkpoint_dir, tmp_path, single_device):
  c = offline_config(checkpoint_dir, jsonl_file(tmp_path / "pairs.jsonl", PAIR_RECORDS), mode="dpo",
                     steps=20)
  history = offline.train_offline(c, tmp_path / "run")
  # Step 1 scores the initial policy against itself as the reference: every implicit reward is
  # 0, so the loss is -log sigmoid(0) = ln 2.
  assert abs(history[0]["reward_margin"]) < 1e-4
  np.testing.assert_allclose(history[0]["loss"], np.log(2.0), atol=1e-4)
  assert [h["reward_accuracy"] for h in history[-5:]] == [1.0] * 5, history
  margins = [h["reward_margin"] for h in history]
  assert np.mean(margins[-3:]) > 0.5, margins
  # A margin m costs -log sigmoid(m): 0.47 at m = 0.5.
  assert np.mean([h["loss"] for h in history[-3:]]) < 0.5, history


@pytest.mark.slow
def test_resumed_sft_equals_an_uninterrupted_run(checkpoint_dir, tmp_path, single_device):
  data = jsonl_file(tmp_path / "demos.jsonl", DEMOS)
  c = offline_config(checkpoint_dir, data, steps=4)  # Two batches per epoch: order matters.
  c.checkpoint.every = 2
  uninterrupted = offline.train_offline(c, tmp_path / "whole")
  # The constant learning rate does not depend on c.steps, so stopping after 2 steps and then
  # asking for 4 is an interruption at step 2.
  c.steps = 2
  first = offline.train_offline(c, tmp_path / "resumed")
  c.steps = 4
  second = offline.train_offline(c, tmp_path / "resumed")
  assert [h["step"] for h in first + second] == [1, 2, 3, 4]
  np.testing.assert_allclose([h["loss"] for h in first + second],
                             [h["loss"] for h in uninterrupted], rtol=1e-6)
  assert [r["step"] for r in metrics.read_metrics(tmp_path / "resumed")] == [1, 2, 3, 4]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8),
               _trained_params(c, tmp_path / "resumed"), _trained_params(c, tmp_path / "whole"))


def test_run_workdir_data_filtered_for_sft_and_paired_for_dpo(checkpoint_dir, tiny_model, tmp_path):
  _, tokenizer = tiny_model
  metrics.TrajectoryWriter(tmp_path).write(1, PAIR_RECORDS[:4])
  metrics.TrajectoryWriter(tmp_path).write(2, PAIR_RECORDS[4:])
  c = offline_config(checkpoint_dir, tmp_path, steps=1)
  c.data.min_reward = 1.0
  records = offline.load_records(tmp_path)
  assert len(records) == 8
  batches = lambda: offline.make_batches(settings_lib.Settings.from_config(c), records, tokenizer.
                                         chat)
  assert batches().num_examples == 4  # The successes.
  c.mode = "dpo"
  assert batches().num_pairs == 4
  # No pair has a chosen side with reward >= 2.
  c.data.min_reward = 2.0
  with pytest.raises(ValueError, match="give 0 preference pairs"):
    batches()


def test_bad_data_and_batch_settings_fail_with_a_clear_message(checkpoint_dir, tmp_path):
  with pytest.raises(ValueError, match="data.path=.*does not exist.*make_demos"):
    offline.load_records(tmp_path / "missing.jsonl")
  with pytest.raises(ValueError, match="without logged trajectories"):
    offline.load_records(tmp_path)
  c = offline_config(checkpoint_dir, jsonl_file(tmp_path / "demos.jsonl", DEMOS))
  c.data.batch_size = 3  # conftest makes 8 devices; the rows are split over all of them.
  with pytest.raises(ValueError, match="data.batch_size=3 must be a multiple of mesh"):
    offline.train_offline(c, tmp_path / "run")


def test_launch_train_runs_sft_from_the_config_file(checkpoint_dir, tmp_path):
  data = jsonl_file(tmp_path / "demos.jsonl", DEMOS)
  workdir = tmp_path / "run"
  launch_train("sft_textcraft.py:local", "--config.steps=2", "--config.optim.warmup_steps=1",
               f"--config.model.name={checkpoint_dir}", f"--config.data.path={data}",
               "--config.data.batch_size=2", "--config.data.max_length=32",
               "--config.log.progress_bar=False", f"--workdir={workdir}")
  rows = metrics.read_metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2]
  assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
  assert checkpoint.Checkpointer(workdir / "checkpoints").all_steps() == [2]
  assert (workdir / "export" / "config.json").exists()
  assert (workdir / "export" / "model.safetensors").exists()


@pytest.mark.parametrize("variant", ["", "local"])
@pytest.mark.parametrize("name", ["sft_textcraft", "dpo_textcraft"])
def test_offline_configs_validate(name, variant):
  c = load(name)(variant)
  settings_lib.Settings.from_config(c)
  assert c.mode == name.split("_")[0] and c.env.name == "textcraft"
  if c.mode == "sft":
    assert c.data.path == "data/textcraft_train_demos.jsonl"
    assert 1e-5 <= c.optim.learning_rate <= 5e-5
  else:
    assert c.dpo.beta == 0.1
  if variant == "local":
    assert c.model.name == "smollm2-135m-instruct" and c.model.remat == "auto"
