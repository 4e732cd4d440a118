"""Reliability of the train loop: env faults, a dying env server, bad model output, context
limits, non-finite updates, crash-safe resume after SIGKILL, and start-up config errors.

Training runs use the tiny checkpoint (tests/tiny.py) on echo-like environments; faults are
injected by tests/faulty_env.py, keyed by task id so that they hit the same episodes under any
policy.
"""

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

import environments
import faulty_env
import tiny
from agentgym_jax import metrics, rollout, trainer
from agentgym_jax.models import weights
from agentgym_jax.models.tokenizer import Tokenizer
from environments.base import StepResult
from environments.http import AgentGymServer
from environments.http.served import free_port
from environments.pool import EnvPool
from rl_helpers import echo_config

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _register_faulty_env():
  faulty_env.register()


def faulty_config(checkpoint_dir: str, steps: int, **options):
  """4 train tasks x 2 samples per step: each step plays every task once (one epoch)."""
  c = echo_config(checkpoint_dir, steps=steps)
  c.env.name = faulty_env.NAME
  c.env.options.num_train = 4
  c.env.options.update(options)
  c.rollout.tasks_per_step = 4
  c.rollout.samples_per_task = 2
  c.algorithm.ppo_epochs = 1
  return c


def _record(monkeypatch, module, name):
  """Wraps module.name so that every call's return value is appended to the returned list."""
  calls = []
  original = getattr(module, name)

  def recorded(*args, **kwargs):
    calls.append(original(*args, **kwargs))
    return calls[-1]

  monkeypatch.setattr(module, name, recorded)
  return calls


# 1. Env faults during training.


@pytest.mark.slow
@pytest.mark.parametrize("failed_episodes", ["exclude", "zero_reward"])
def test_env_errors_and_timeouts_end_only_their_episodes(failed_episodes, checkpoint_dir, tmp_path,
                                                         monkeypatch):
  tiny.one_device(monkeypatch)
  # Task 100 raises on its first step, task 101 hangs 2 s past the 0.5 s step timeout.
  c = faulty_config(checkpoint_dir, steps=2, raise_tasks=(0,), hang_tasks=(1,), hang_s=2.0)
  c.env.step_timeout = 0.5
  c.env.failed_episodes = failed_episodes
  collected = _record(monkeypatch, rollout, "collect")
  packed = _record(monkeypatch, rollout, "pack")
  history = trainer.train(c, tmp_path)

  assert [h["step"] for h in history] == [1, 2]
  for h in history:
    # 2 of the 8 episodes of each step per fault.
    assert h["termination/env_error"] == pytest.approx(0.25)
    assert h["termination/env_timeout"] == pytest.approx(0.25)
    assert h["nonfinite_steps"] == 0 and np.isfinite(h["loss"])
  for (trajectories, _), batch in zip(collected, packed):
    num_rows = len(trajectories)
    for i, t in enumerate(trajectories):
      task = t.task_id - faulty_env.FIRST_TRAIN_ID
      expected = {0: rollout.ENV_ERROR, 1: rollout.ENV_TIMEOUT}.get(task)
      if expected is None:
        assert t.termination in (rollout.DONE, rollout.HORIZON)
        np.testing.assert_array_equal(batch.loss_mask[i, :len(t.tokens)], t.loss_mask)
        assert batch.rewards[i] == t.reward
        continue
      assert t.termination == expected and t.num_turns == 1
      assert ("injected fault" if task == 0 else "took over 0.5 s") in t.error
      assert sum(t.loss_mask) > 0  # The reply was generated; only the pack decides its fate.
      assert batch.rewards[i] == 0.0
      if failed_episodes == "exclude":
        assert not batch.loss_mask[i].any()
        assert batch.group_ids[i] == num_rows + i  # A group of its own: no baseline shift.
      else:
        np.testing.assert_array_equal(batch.loss_mask[i, :len(t.tokens)], t.loss_mask)
        assert batch.group_ids[i] == t.group


# 2. An HTTP env server dying mid-run.


@pytest.mark.slow
def test_training_rides_out_an_http_server_dying(checkpoint_dir, tmp_path, monkeypatch):
  """Step 2: the server dies mid-episode and is back 0.3 s later; step 4: it is down for the
  whole rollout. Both steps' episodes end as env_error and the next step recovers."""
  tiny.one_device(monkeypatch)
  port = free_port()
  servers = [AgentGymServer("echo", options={"turns": 2}, port=port).start()]
  c = echo_config(checkpoint_dir, steps=5)
  c.env.name = "http"
  c.env.options = {
      "base_url": f"http://127.0.0.1:{port}", "env": "echo", "retries": 3, "backoff_s": 0.05
  }
  c.env.step_timeout = 30.0
  c.rollout.tasks_per_step = 4
  c.rollout.samples_per_task = 2
  c.algorithm.ppo_epochs = 1

  def restart():
    servers.append(AgentGymServer("echo", options={"turns": 2}, port=port).start())

  rollouts = 0
  original_collect, original_step = rollout.collect, EnvPool.step_async

  def step_killing_the_server(pool, requests):
    servers[-1].shutdown()
    threading.Timer(0.3, restart).start()
    monkeypatch.setattr(EnvPool, "step_async", original_step)
    return original_step(pool, requests)

  def collect(*args, **kwargs):
    nonlocal rollouts
    rollouts += 1
    if rollouts == 2:
      monkeypatch.setattr(EnvPool, "step_async", step_killing_the_server)
    if rollouts == 4:
      servers[-1].shutdown()
      try:
        return original_collect(*args, **kwargs)
      finally:
        restart()
    return original_collect(*args, **kwargs)

  monkeypatch.setattr(rollout, "collect", collect)
  try:
    history = trainer.train(c, tmp_path)
  finally:
    for server in servers:
      server.shutdown()
  errors = [h["termination/env_error"] for h in history]
  assert errors == [0.0, 1.0, 0.0, 1.0, 0.0], errors
  assert all(h["nonfinite_steps"] == 0 for h in history)


# 3. Bad model output straight to each adapter.

BAD_REPLIES = {
    "empty": "",
    "huge": "Action: " + "x" * 100_000,
    "lone surrogates": "Thought: \ud800\udfff?\n\nAction: \udc80 craft \ud83d",
    "control characters": "Thought: \x00\x07\x1b[31m\r\n\nAction: \x00\x08look\x7f\x0b\x0c",
    "several action lines": "Action: inventory\nAction: look around\nAction: go forward",
    "no action": "I am not sure what to do here.",
    "only a marker": "Action:",
}


@pytest.mark.parametrize(
    "name",
    ["textcraft", "babyai", "searchqa", "echo",
     pytest.param("sciworld", marks=pytest.mark.slow)])  # sciworld starts a JVM, ~20 s
def test_bad_replies_get_an_observation_never_an_exception(name):
  adapter = environments.make(name)
  try:
    task_id = adapter.task_ids("test")[0]
    for what, reply in BAD_REPLIES.items():
      adapter.reset(task_id)
      result = adapter.step(reply)
      assert isinstance(result, StepResult), what
      assert isinstance(result.observation, str) and result.observation, what
      assert np.isfinite(result.reward), what
      # The observation goes back into the conversation: it must encode, and it must not echo
      # a 100k-character reply whole.
      result.observation.encode("utf-8", "surrogatepass")
      assert len(result.observation) < 20_000, (what, len(result.observation))
  finally:
    adapter.close()


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=200))
def test_sciworld_parse_action_is_one_stripped_line_or_none(reply):
  from environments.sciworld.env import parse_action

  action = parse_action(reply)
  assert action is None or (action and action == action.strip() and "\n" not in action)
  marked = "Thought: t\n\nAction: " + reply
  # Lone surrogates (which the JVM bridge cannot encode) come back replaced.
  clean = reply.encode("utf-8", "replace").decode("utf-8")
  if clean.splitlines() and clean.splitlines()[0].strip():
    assert parse_action(marked) == clean.splitlines()[0].strip()


# 4. The context limit.


@pytest.mark.slow
@pytest.mark.parametrize("room", ["one turn", "no turn"])
def test_a_full_context_ends_episodes_as_context(room, checkpoint_dir, tmp_path, monkeypatch):
  tiny.one_device(monkeypatch)
  c = echo_config(checkpoint_dir, steps=1)
  c.rollout.tasks_per_step = 4
  c.log.trajectories = True
  chat = Tokenizer.from_pretrained(checkpoint_dir).chat
  env = environments.make("echo", turns=2)
  first = [{
      "role": "user", "content": f"{env.instruction}\n\n{env.reset(env.task_ids('train')[0])}"
  }]
  prompt = len(chat.render(first, add_generation_prompt=True))
  # "one turn": the first reply fits, the next user turn (>= 3 tokens) plus a reply does not.
  # "no turn": not even the first reply fits after the prompt.
  c.rollout.max_context = prompt + c.rollout.max_new_tokens + (1 if room == "one turn" else -1)
  [h] = trainer.train(c, tmp_path)
  trajectories = metrics.read_trajectories(tmp_path, 1)
  assert all(t["num_tokens"] <= c.rollout.max_context for t in trajectories)
  if room == "no turn":
    assert h["termination/context"] == 1.0
    assert all(t["num_turns"] == 0 and t["num_trained_tokens"] == 0 for t in trajectories)
  else:
    # A right first answer would go on to turn 2, which does not fit; a wrong one ends it.
    assert all(t["num_turns"] == 1 for t in trajectories)
    for t in trajectories:
      reply = t["messages"][1]["content"]
      right = next((s for s in reply if s in "01"),
                   None) == env.task_info(t["task_id"])["sequence"][0]
      assert t["termination"] == ("context" if right else "done"), t
    assert 0 < h["termination/context"] < 1
  assert h["nonfinite_steps"] == 0 and np.isfinite(h["loss"])


# 5. Non-finite updates.


@pytest.mark.slow
def test_nonfinite_updates_are_skipped_then_stop_the_run(checkpoint_dir, tmp_path, monkeypatch):
  tiny.one_device(monkeypatch)
  # NaN rewards -> NaN advantages -> NaN gradients on every update.
  c = faulty_config(checkpoint_dir, steps=1, nan_reward=True)
  c.algorithm.num_minibatches = 1
  c.optim.max_consecutive_nonfinite = 2
  c.checkpoint.every = 1
  c.checkpoint.export_hf = True
  [h] = trainer.train(c, tmp_path)
  assert h["nonfinite_steps"] == 1
  initial = weights.SafetensorsReader(pathlib.Path(checkpoint_dir))
  trained = weights.SafetensorsReader(tmp_path / "export")
  for name in initial:  # The skipped update left every parameter as it was (export: bf16).
    np.testing.assert_array_equal(
        np.asarray(initial[name]).astype(trained[name].dtype), trained[name], err_msg=name)
  # Resumed, the restored counter reaches 2 on the next update.
  c.steps = 3
  with pytest.raises(
      FloatingPointError, match=r"^2 consecutive updates had non-finite "
      r"gradients; stopping \(optim.max_consecutive_nonfinite=2\)$"):
    trainer.train(c, tmp_path)
  assert [row["step"] for row in metrics.read_metrics(tmp_path)] == [1, 2]


# 6. Crash safety: SIGKILL, restart, and the same result as an uninterrupted run.


def _launch_command(checkpoint_dir: str, workdir: pathlib.Path, steps: int) -> list[str]:
  return [
      sys.executable,
      str(REPO / "launch" / "train.py"), f"--config={REPO / 'configs' / 'ablation_echo.py'}:long",
      f"--workdir={workdir}", f"--config.model.name={checkpoint_dir}", f"--config.steps={steps}",
      "--config.rollout.tasks_per_step=2", "--config.rollout.samples_per_task=2",
      "--config.rollout.max_new_tokens=4", "--config.rollout.max_context=128",
      "--config.checkpoint.every=1", "--config.checkpoint.keep=10",
      "--config.checkpoint.export_hf=True", "--config.log.progress_bar=False",
      "--config.mesh.fsdp=1", "--config.mesh.data=-1"
  ]


_ONE_DEVICE = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def _checkpoint_steps(workdir: pathlib.Path) -> list[int]:
  directory = workdir / "checkpoints"
  return sorted(
      int(p.name) for p in directory.iterdir() if p.name.isdigit()) if (directory.exists()) else []


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_uninterrupted_result(checkpoint_dir, tmp_path):
  """Three launches of ~30-60 s each: straight, killed after checkpoint 2, restarted."""
  steps = 5
  straight = subprocess.Popen(_launch_command(checkpoint_dir, tmp_path / "straight",
                                              steps), env=_ONE_DEVICE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
  workdir = tmp_path / "killed"
  killed = subprocess.Popen(_launch_command(checkpoint_dir, workdir, steps), env=_ONE_DEVICE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 900
  # A step directory appears under its final name only once Orbax has finalized it.
  while 2 not in _checkpoint_steps(workdir):
    assert killed.poll() is None and time.monotonic() < deadline, "no checkpoint 2"
    time.sleep(0.05)
  killed.send_signal(signal.SIGKILL)
  assert killed.wait() == -signal.SIGKILL
  completed = _checkpoint_steps(workdir)
  assert 2 <= completed[-1] < steps, completed
  # What a kill during the next checkpoint write leaves behind: an unfinished temporary step.
  partial = workdir / "checkpoints" / f"{completed[-1] + 1}.orbax-checkpoint-tmp-1234"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "garbage").write_bytes(b"\x00" * 100)

  resumed = subprocess.run(_launch_command(checkpoint_dir, workdir, steps), env=_ONE_DEVICE,
                           capture_output=True, text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed from step {completed[-1]}" in resumed.stdout
  assert straight.wait(timeout=900) == 0, straight.stderr.read()[-3000:]
  assert not partial.exists()
  assert _checkpoint_steps(workdir) == list(range(1, steps + 1))

  rows_straight = metrics.read_metrics(tmp_path / "straight")
  rows_resumed = metrics.read_metrics(workdir)
  assert [r["step"] for r in rows_resumed] == list(range(1, steps + 1))
  for a, b in zip(rows_straight, rows_resumed):
    for key in ("reward", "loss", "grad_norm", "entropy"):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)
  final_straight = weights.SafetensorsReader(tmp_path / "straight" / "export")
  final_resumed = weights.SafetensorsReader(workdir / "export")
  for name in final_straight:
    np.testing.assert_allclose(final_straight[name], final_resumed[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)


# 7. Config errors at start-up.


def _launch_with(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
  command = [
      sys.executable,
      str(REPO / "launch" / "train.py"), f"--config={REPO / 'configs' / 'grpo_textcraft.py'}:local",
      f"--workdir={tmp_path / 'run'}", *overrides
  ]
  return subprocess.run(command, capture_output=True, text=True, timeout=300, env=_ONE_DEVICE)


@pytest.mark.parametrize("override, message", [
    ("--config.rollout.top_p=2.0", "error: invalid config: rollout.top_p=2.0 must be in (0, 1]"),
    ("--config.env.failed_episodes=drop",
     "error: invalid config: env.failed_episodes='drop' is not 'exclude' or 'zero_reward'"),
])
def test_invalid_values_fail_at_start_up_with_one_line(override, message, tmp_path):
  result = _launch_with(tmp_path, override)
  assert result.returncode == 1
  assert "Traceback" not in result.stderr, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr[-2000:]
  assert not (tmp_path / "run" / "checkpoints").exists()
