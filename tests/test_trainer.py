"""The RL train loop end to end: learning on a toy task, horizon caps, exact resume, launch."""

import re
import shutil

import numpy as np
import pytest

from agentgym_jax import config as config_lib
from agentgym_jax import batch, metrics, task_sampling, trainer
from rl_helpers import assert_resumed_run_matches, assert_same_tensors, check_config, echo_config
from rl_helpers import launch_train
from env_helpers import CategorisedTasks


# About a minute each: GRPO and GAE (values, remat) run by default, the other estimators (each
# with worked-value tests in test_advantages.py) with `-m slow`.
@pytest.mark.parametrize("advantage", [
    "grpo",
    "gae",
    pytest.param("rloo", marks=pytest.mark.slow),
    pytest.param("reinforce_plus_plus", marks=pytest.mark.slow),
    pytest.param("gigpo", marks=pytest.mark.slow),
])
def test_tiny_policy_learns_echo(advantage, checkpoint_dir, tmp_path, single_device):
  c = echo_config(checkpoint_dir, advantage)
  if advantage == "gae":
    c.algorithm.value_coef = 1.0
    c.model.remat = "full"  # Also covers rematerialised training next to cached sampling.
  history = trainer.train(c, tmp_path)
  success = [h["success"] for h in history]
  # A random policy answers both turns right a few percent of the time.
  assert np.mean(success[:3]) < 0.3
  assert max(np.mean(success[i:i + 3]) for i in range(len(success) - 2)) >= 0.9, success
  if advantage == "gigpo":
    # Echo shows a task's samples the same symbols, so the second turns of a task share their
    # state. One goes unshared only when it is its task's sole survivor of the first turn, whose
    # 7 failures cap success at 57/64 < 0.9: in steps of success >= 0.9 all are shared.
    anchored = [h["gigpo/anchored_turns"] for h in history]
    assert all(a == 1.0 for a, s in zip(anchored, success) if s >= 0.9), (anchored, success)
    assert min(anchored) < 1.0  # ... while early steps, with few survivors, leave some alone.


@pytest.mark.slow
def test_horizon_schedule_caps_turns_per_stage(checkpoint_dir, tmp_path, single_device):
  c = echo_config(checkpoint_dir, steps=4)
  c.env.options.turns = 3
  c.horizon.kind = "stepwise"
  c.horizon.caps = (1, 2)
  c.horizon.every = 2
  c.log.trajectories = True
  c.rollout.tasks_per_step = 4
  history = trainer.train(c, tmp_path)
  assert [h["horizon_cap"] for h in history] == [1, 1, 2, 2]
  for step, cap in zip(range(1, 5), [1, 1, 2, 2]):
    trajectories = metrics.read_trajectories(tmp_path, step)
    turns = [t["num_turns"] for t in trajectories]
    assert max(turns) <= cap
    # Trajectories still going at the cap end as "horizon" (3-turn episodes never finish).
    assert all(t["termination"] in ("horizon", "done") for t in trajectories)
    assert any(t["termination"] == "horizon" for t in trajectories) or cap == 2
    # Each record knows its sample within its group and its GRPO advantage: the group's
    # rewards centred on their mean (and scaled by their spread), so of the same sign.
    groups = {}
    for t in trajectories:
      groups.setdefault(t["group"], []).append(t)
    assert len(groups) == c.rollout.tasks_per_step
    for group in groups.values():
      assert [t["sample"] for t in group] == list(range(c.rollout.samples_per_task))
      mean = np.mean([t["reward"] for t in group])
      for t in group:
        assert np.sign(t["advantage"]) == np.sign(round(t["reward"] - mean, 6))


@pytest.mark.slow
def test_resumed_run_matches_uninterrupted_run(checkpoint_dir, tmp_path, single_device):
  c = echo_config(checkpoint_dir, steps=4)
  c.checkpoint.every = 2
  c.checkpoint.export_hf = True
  straight = trainer.train(c, tmp_path / "straight")
  # The resumed run keeps its optimizer state in host memory between updates (checkpointed and
  # restored from there), which moves it without changing it.
  c.optim.offload_state = True
  assert_resumed_run_matches(straight, c, tmp_path / "resumed",
                             ("reward", "loss", "grad_norm", "entropy", "policy/ratio_mean"))
  logged = [row["step"] for row in metrics.read_metrics(tmp_path / "resumed")]
  assert logged == [1, 2, 3, 4]
  assert_same_tensors(tmp_path / "straight" / "export", tmp_path / "resumed" / "export")
  # A run stopped between checkpoints is exported by re-running it with steps = its last one.
  shutil.rmtree(tmp_path / "resumed" / "export")
  assert trainer.train(c, tmp_path / "resumed") == []
  assert_same_tensors(tmp_path / "straight" / "export", tmp_path / "resumed" / "export")


def test_rows_pad_to_few_lengths_with_under_a_third_of_a_row_of_padding():
  assert [batch.packed_length(n) for n in (1, 128, 129, 193, 740, 769, 1025, 1300, 1537)
         ] == [128, 128, 192, 256, 768, 1024, 1536, 1536, 2048]
  lengths = np.arange(129, 20000)
  widths = np.array([batch.packed_length(int(n)) for n in lengths])
  assert (widths >= lengths).all() and (widths < 1.5 * lengths).all()
  assert len(set(widths.tolist())) == 15  # 192, 256, 384, ..., 16384, 24576: two an octave.


def test_invalid_config_fails_at_start_with_one_line(checkpoint_dir, tmp_path):
  c = echo_config(checkpoint_dir)
  c.algorithm.advantage = "ppo2"
  with pytest.raises(ValueError, match=r"algorithm.advantage='ppo2' is not one of"):
    trainer.train(c, tmp_path)
  with pytest.raises(AttributeError, match="locked"):
    c.algorithm.clip_eps = 0.3


def test_an_offline_config_is_refused_by_the_rl_loop(checkpoint_dir, tmp_path):
  c = echo_config(checkpoint_dir)
  c.mode = "sft"
  c.data.path = str(tmp_path / "demos.jsonl")
  with pytest.raises(ValueError,
                     match=r"mode='sft': trainer.train runs RL .* offline.train_offline"):
    trainer.train(c, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_a_minibatch_that_does_not_split_over_the_mesh_fails_at_start(checkpoint_dir, tmp_path):
  c = echo_config(checkpoint_dir)
  c.mesh.fsdp = -1  # The 8 test devices.
  c.rollout.tasks_per_step = 2
  c.rollout.samples_per_task = 2
  with pytest.raises(
      ValueError, match=r"a minibatch of 2 trajectories .* does not split over "
      r"the 8 devices"):
    trainer.train(c, tmp_path)


@pytest.mark.slow
def test_launch_train_smoke_writes_checkpoint_metrics_trajectories(checkpoint_dir, tmp_path):
  workdir = tmp_path / "run"
  result = launch_train("ablation_echo.py:long", f"--workdir={workdir}",
                        f"--config.model.name={checkpoint_dir}", "--config.log.progress_bar=True",
                        "--config.log.trajectories=True", "--config.checkpoint.export_hf=True",
                        "--config.steps=2", "--config.rollout.tasks_per_step=2",
                        "--config.rollout.samples_per_task=2", "--config.rollout.max_new_tokens=4",
                        "--config.rollout.max_context=128", "--config.checkpoint.every=1",
                        "--config.mesh.fsdp=1", "--config.mesh.data=-1")
  # Off a terminal: one plain line a step on stdout; no library INFO logs (Orbax's checkpoint
  # manager, JAX's search for a TPU backend) on stderr.
  assert [line.split("  ")[0] for line in result.stdout.splitlines()] == ["step 1/2", "step 2/2"]
  assert not re.search(r"^I\d{4} ", result.stderr, re.MULTILINE), result.stderr[:2000]
  assert "Unable to initialize backend" not in result.stderr
  rows = metrics.read_metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2]
  assert sorted(
      p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
  assert len(metrics.read_trajectories(workdir, 2)) == 4
  assert (workdir / "export" / "config.json").exists()
  assert (workdir / "export" / "tokenizer.json").exists()


@pytest.mark.slow
def test_launch_train_local_config_on_embedded_model(tmp_path):
  workdir = tmp_path / "run"
  # One CPU device, as on a workstation (the test session's 8 virtual devices would not split
  # this small batch).
  launch_train(
      "grpo_textcraft.py:local",
      f"--workdir={workdir}",
      "--config.steps=2",
      "--config.rollout.tasks_per_step=2",
      "--config.rollout.samples_per_task=2",
      "--config.rollout.max_new_tokens=16",
      "--config.horizon.caps=(2,)",
      "--config.checkpoint.every=1",
      # The recipe's warm start and stage evaluations are tested on the tiny model
      # (tests/test_recipe.py); here the RL run alone.
      "--config.warm_start.steps=0",
      "--config.eval.stages=False",
      devices=1,
      timeout=1800)
  assert [r["step"] for r in metrics.read_metrics(workdir)] == [1, 2]
  assert (workdir / "export" / "model.safetensors").exists()


def test_rollout_with_bf16_rematerialised_policy(checkpoint_dir):
  import jax
  import jax.numpy as jnp

  from agentgym_jax import rollout
  from agentgym_jax.models import load_model
  from agentgym_jax.sampling import Sampler
  from environments.pool import EnvPool

  model, tokenizer = load_model(checkpoint_dir, dtype=jnp.bfloat16, remat="full")
  sampler = Sampler(model, cache_slots=64, max_batch=4)
  with EnvPool("echo", 4, options={"turns": 2}) as pool:
    player = rollout.Player(sampler, sampler.params, pool, tokenizer.chat,
                            rollout.TurnSampling(max_new_tokens=2), max_context=64)
    trajectories, _ = rollout.collect(player, [(0, 0), (0, 0), (1, 1), (1, 1)], horizon=2,
                                      key=jax.random.key(0))
  for t in trajectories:
    assert t.num_turns >= 1 and sum(t.loss_mask) >= 1
    assert len(t.tokens) == len(t.loss_mask) == len(t.sampler_logprobs)


def test_a_curriculum_draws_each_stage_from_its_categories():
  pool = CategorisedTasks({0: "depth1", 1: "depth2", 2: "depth1", 3: "depth3", 4: "depth2"})
  orders = task_sampling.stage_task_orders(pool, (("depth1",), ("depth1", "depth2")), seed=7)
  assert sorted(orders[0].take(0, 2)) == [0, 2]  # One epoch of the two depth-1 tasks.
  assert sorted(orders[1].take(0, 4)) == [0, 1, 2, 4]
  assert set(orders[1].take(4, 40)) == {0, 1, 2, 4}  # Depth 3 never comes up.
  # Orders are pure functions of (tasks, seed), as a resumed run needs.
  again = task_sampling.stage_task_orders(pool, (("depth1",), ("depth1", "depth2")), seed=7)
  assert again[1].take(3, 9) == orders[1].take(3, 9)
  # No curriculum: one order over every train task.
  (everything,) = task_sampling.stage_task_orders(pool, (), seed=7)
  assert sorted(everything.take(0, 5)) == [0, 1, 2, 3, 4]


def test_a_curriculum_stage_without_tasks_fails_with_the_categories_there_are():
  pool = CategorisedTasks({0: "depth1", 1: "depth2"})
  with pytest.raises(
      config_lib.ConfigError,
      match=r"rollout.curriculum\[1\]=\('depth9',\) matches none of the 2 train "
      r"tasks \(their categories: \['depth1', 'depth2'\]\)"):
    task_sampling.stage_task_orders(pool, (("depth1",), ("depth9",)), seed=0)


@pytest.mark.parametrize("curriculum", [("depth1",), ((),), (("depth1", 2),)])
def test_a_malformed_curriculum_fails_at_start_up(curriculum):
  c = config_lib.base_config()
  c.rollout.curriculum = curriculum
  check_config(c, "rollout.curriculum=.* must be a tuple of non-empty tuples of category names")
