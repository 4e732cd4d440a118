"""The recipe of a run: a warm start on demonstrations, then RL from the warm-started policy,
each stage resumed where it stopped, each stage's policy evaluated once (in any workdir) and
tabled against the stage before."""

import json
import shutil

import pytest

from agentgym_jax import config as config_lib
from agentgym_jax import state as state_lib
from agentgym_jax import settings as settings_lib
from agentgym_jax import demonstrations, evaluation, metrics, recipe, rollout, trainer
from agentgym_jax.config import set_key
from rl_helpers import check_config, conversation, jsonl_file

# The runs use one device, as on a workstation.
pytestmark = pytest.mark.usefixtures("single_device")

# Echo conversations (a prompt of symbols, the reply repeating them).
DEMOS = [{"messages": conversation(symbols, symbols)} for symbols in ("1 0", "0 0", "1 1", "0 1")]


def config(checkpoint_dir, tmp_path):
  """A 2-step RL run of 1-turn echo after 4 SFT steps on DEMOS, written to `tmp_path`."""
  c = config_lib.base_config()
  c.model.name = checkpoint_dir
  config_lib.tiny_echo(c)
  c.steps = 2
  c.env.options.turns = 1
  config_lib.fixed_horizon(1)(c)
  c.rollout.tasks_per_step = 2
  c.rollout.samples_per_task = 2
  c.rollout.max_context = 64
  c.warm_start.steps = 4
  c.warm_start.demonstrations = str(jsonl_file(tmp_path / "demos.jsonl", DEMOS))
  c.warm_start.batch_size = 2
  c.checkpoint.every = 2
  return c


@pytest.mark.slow
def test_rl_starts_from_the_warm_started_policy_and_a_stopped_warm_start_resumes(
    checkpoint_dir, tmp_path, monkeypatch):
  c = config(checkpoint_dir, tmp_path)
  # Stop the first attempt after the SFT's last checkpoint, before its export.
  export, stops = state_lib.export_policy, []

  def stop_once(*args):
    if not stops:
      stops.append(1)
      raise KeyboardInterrupt
    export(*args)

  monkeypatch.setattr(state_lib, "export_policy", stop_once)
  with pytest.raises(KeyboardInterrupt):
    recipe.train(c, tmp_path / "run")
  policies = []
  rl_train = trainer.train
  monkeypatch.setattr(trainer, "train",
                      lambda rl, workdir: policies.append(rl.model.name) or rl_train(rl, workdir))
  history = recipe.train(c, tmp_path / "run")

  warm = tmp_path / "run" / "warm_start"
  # The SFT run resumed at its step-4 checkpoint: 4 logged steps, none twice, then exported.
  assert [row["step"] for row in metrics.read_metrics(warm)] == [1, 2, 3, 4]
  assert (warm / "export" / "config.json").exists()
  assert policies == [str(warm / "export")]
  assert [row["step"] for row in history] == [1, 2]
  # Started again once finished, the warm start is not run a second time.
  monkeypatch.setattr(recipe.offline, "train_offline",
                      lambda *args: pytest.fail("the warm start ran twice"))
  assert recipe.warm_start(settings_lib.Settings.from_config(c), warm) == warm / "export"


def test_demonstrations_are_made_with_the_expert_once(tmp_path, monkeypatch):
  c = config_lib.base_config()
  c.env.name = "textcraft"
  c.warm_start.steps = 1
  c.warm_start.max_tasks = 2
  path = recipe.demonstrations_file(settings_lib.Settings.from_config(c), tmp_path)
  records = [json.loads(line) for line in path.read_text().splitlines()]
  assert len(records) == 2 and all(
      r["success"] and r["source"] == demonstrations.ORACLE for r in records)
  monkeypatch.setattr(demonstrations, "demonstrate_tasks",
                      lambda *a, **k: pytest.fail("made twice"))
  assert recipe.demonstrations_file(settings_lib.Settings.from_config(c), tmp_path) == path


def test_demonstrations_are_made_in_the_runs_action_format(tmp_path):
  c = config_lib.base_config()
  c.env.name = "searchqa"
  c.env.action_format = "tool_call"
  c.warm_start.steps = 1
  c.warm_start.max_tasks = 2
  records = [
      json.loads(line) for line in recipe.demonstrations_file(settings_lib.Settings.from_config(c),
                                                              tmp_path).read_text().splitlines()
  ]
  assert len(records) == 2 and all(r["source"] == demonstrations.HOPS for r in records)
  for record in records:
    assert [tool["function"]["name"] for tool in record["tools"]] == ["search", "answer"]
    assert all("\n<tool_call>\n" in m["content"] for m in record["messages"][1::2])


@pytest.mark.parametrize("key, value, message", [
    ("env.name", "echo", r"warm_start.demonstrations must name a JSONL .* env 'echo' has no "
     r"expert"),
    ("mode", "sft", r"warm_start is a stage of an RL run, not of mode='sft'"),
    ("warm_start.learning_rate", 0.0, r"warm_start.learning_rate and batch_size must be > 0"),
])
def test_warm_start_settings_are_checked_at_start_up(key, value, message):
  c = config_lib.base_config()
  c.warm_start.steps = 10
  c.data.path = "demos.jsonl"
  set_key(c, key, value)
  check_config(c, message)


@pytest.mark.slow
def test_each_stage_is_evaluated_once_and_tabled(checkpoint_dir, tmp_path, monkeypatch, capsys):
  c = config(checkpoint_dir, tmp_path)
  c.checkpoint.export_hf = True
  c.eval.stages = True
  c.eval.max_tasks = 4
  c.eval.horizon = 1
  recipe.train(c, tmp_path / "run")
  evaluated = tmp_path / "run" / "evaluation"
  summaries = {
      stage: json.loads((evaluated / f"{name}.json").read_text())
      for stage, name in (("initial", "initial"), ("warm start", "warm_start"), ("RL", "rl"))
  }
  assert all(s["num_tasks"] == 4 and s["k"] == 1 for s in summaries.values())
  for s in summaries.values():  # One record a task, in task-id order, of its one sample.
    task_ids = [t["task_id"] for t in s["tasks"]]
    assert task_ids == sorted(task_ids) and all(len(t["success"]) == 1 for t in s["tasks"])
  # The RL stage is the exported policy, played as launch/evaluate.py plays it.
  direct, _ = recipe.evaluate_policy(settings_lib.Settings.from_config(c),
                                     str(tmp_path / "run" / "export"), 4)
  assert direct == summaries["RL"]
  table = (evaluated / "table.txt").read_text()
  assert table.strip() == recipe.stage_table(summaries)
  assert [line.split(":")[0] for line in table.splitlines() if " -> " in line
         ] == ["initial -> warm start", "warm start -> RL"]
  assert recipe.stage_table(summaries) in capsys.readouterr().out
  # Run again, nothing is played or trained twice and the table is the same; nor, with the
  # workdir's summaries gone, is a policy played again: each stage's is in the cache.
  monkeypatch.setattr(recipe, "evaluate_policy", lambda *a, **k: pytest.fail("played twice"))
  recipe.train(c, tmp_path / "run")
  assert (evaluated / "table.txt").read_text() == table
  assert len(list((tmp_path / "evaluation_cache").iterdir())) == 3
  shutil.rmtree(evaluated)
  recipe.train(c, tmp_path / "run")
  assert (evaluated / "table.txt").read_text() == table
  assert capsys.readouterr().out.count("reused the") == 3


def _summary(avg, pass_, by_category):
  return {
      "k": 2, "num_tasks": sum(n for n, _, _ in by_category.values()), "avg@k": avg,
      "pass@k": pass_, "categories": {
          name: {"num_tasks": n, "avg@k": a, "pass@k": p} for name, (n, a, p) in by_category.items()
      }
  }


def test_the_stage_table_has_a_row_per_category_and_a_column_pair_per_stage():
  table = recipe.stage_table({
      "initial": _summary(0.0, 0.0, {"depth1": (2, 0.0, 0.0), "depth2": (2, 0.0, 0.0)}),
      "RL": _summary(0.375, 0.5, {"depth1": (2, 0.75, 1.0), "depth2": (2, 0.0, 0.0)}),
  })
  lines = table.splitlines()
  assert lines[0].startswith("k = 2 samples per task")
  assert lines[1].split() == [
      "category", "tasks", "initial", "avg@2", "pass@2", "RL", "avg@2", "pass@2"
  ]
  rows = {line.split()[0]: line.split()[1:] for line in lines[3:6]}
  # depth1 under RL: 3 of 4 samples, both tasks at least once.
  assert rows == {
      "depth1": ["2", "0.0%", "0.0%", "75.0%",
                 "100.0%"], "depth2": ["2", "0.0%", "0.0%", "0.0%", "0.0%"],
      "all": ["4", "0.0%", "0.0%", "37.5%", "50.0%"]
  }


def test_a_stage_without_a_category_shows_dashes():
  table = recipe.stage_table({
      "initial": _summary(0.0, 0.0, {"depth1": (2, 0.0, 0.0)}),
      "RL": _summary(0.5, 0.5, {"depth1": (1, 1.0, 1.0), "depth2": (1, 0.0, 0.0)}),
  })
  depth2 = next(line for line in table.splitlines() if line.startswith("depth2"))
  assert depth2.split() == ["depth2", "1", "-", "-", "0.0%", "0.0%"]


def _played(successes, categories):
  """The summary of one sample of each task of `categories`, those in `successes` solved."""
  return evaluation.summarize([
      rollout.Trajectory(task_id=t, group=t, success=t in successes,
                         turn_rewards=[float(t in successes)]) for t in categories
  ], categories)


def test_the_stage_table_compares_each_stage_with_the_one_before_task_by_task():
  categories = {t: "depth1" if t < 5 else "depth2" for t in range(10)}
  table = recipe.stage_table({
      "initial": _played({9}, categories), "warm start": _played({9}, categories),
      "RL": _played(set(range(8)), categories)
  })
  # RL solves 0-7 and no longer 9: 8 gained, 1 lost, p = 2 (C(9,0) + C(9,1)) / 2^9 = 0.039.
  assert table.splitlines()[-5:] == [
      "",
      "initial -> warm start: +0 gained, -0 lost of 10 tasks (paired sign test, exact two-sided "
      "p = 1)",
      "  by category: depth1 +0 -0, depth2 +0 -0",
      "warm start -> RL: +8 gained, -1 lost of 10 tasks (paired sign test, exact two-sided "
      "p = 0.039)",
      "  by category: depth1 +5 -0, depth2 +3 -1",
  ]


def test_a_stage_summary_without_per_task_records_is_tabled_without_a_paired_test():
  categories = {0: "all", 1: "all"}
  old, new = _played({0}, categories), _played({0, 1}, categories)
  del old["tasks"]
  table = recipe.stage_table({"initial": old, "RL": new})
  assert table.splitlines()[-1] == (
      "initial -> RL: the paired test needs per-task records; the summary of initial has none "
      "(written before they were kept; delete it to evaluate again)")
  assert table.splitlines()[3].split() == ["all", "2", "50.0%", "50.0%", "100.0%", "100.0%"]


@pytest.fixture
def plays(monkeypatch):
  """The policies played by recipe.evaluate_policy, which is replaced by one that plays
  nothing and returns the summary of one solved and one failed task."""
  played = []

  def play(settings, model_name, rows, start=None):
    played.append(model_name)
    return _played({0}, {0: "all", 1: "all"}), []

  monkeypatch.setattr(recipe, "evaluate_policy", play)
  return played


def evaluate(c, policy, workdir):
  return recipe.evaluate_stage(settings_lib.Settings.from_config(c), "initial", str(policy),
                               workdir / "evaluation" / "initial.json")


def test_a_policy_evaluated_with_the_same_settings_is_not_played_again_in_another_workdir(
    checkpoint_dir, tmp_path, plays, capsys):
  c = config(checkpoint_dir, tmp_path)
  assert c.eval.cache_dir == str(tmp_path / "evaluation_cache")  # conftest's, not the user's.
  first = evaluate(c, checkpoint_dir, tmp_path / "a")
  (entry,) = (tmp_path / "evaluation_cache").iterdir()
  assert json.loads(entry.read_text()) == first
  # The same files elsewhere (another run's identical export) are the same policy.
  copy = shutil.copytree(checkpoint_dir, tmp_path / "copy")
  assert evaluate(c, copy, tmp_path / "b") == first
  assert plays == [checkpoint_dir]
  assert (tmp_path / "b" / "evaluation" / "initial.json").read_text() == entry.read_text()
  assert capsys.readouterr().out.splitlines()[-1] == (
      f"reused the initial policy's evaluation from {entry} (the same model files and "
      "evaluation settings): avg@1 50.0%, pass@1 50.0%")


@pytest.mark.parametrize("key, value", [
    ("eval.horizon", 2),
    ("eval.temperature", 0.5),
    ("eval.samples_per_task", 2),
    ("eval.max_tasks", 3),
    ("rollout.max_new_tokens", 3),
    ("rollout.cache_dtype", "bfloat16"),
    ("model.dtype", "bfloat16"),
    ("env.options.turns", 2),
])
def test_a_changed_setting_plays_the_evaluation_again(checkpoint_dir, tmp_path, plays, key, value):
  c = config(checkpoint_dir, tmp_path)
  evaluate(c, checkpoint_dir, tmp_path / "a")
  set_key(c, key, value)
  evaluate(c, checkpoint_dir, tmp_path / "b")
  assert plays == [checkpoint_dir] * 2
  assert len(list((tmp_path / "evaluation_cache").iterdir())) == 2


def test_a_seed_changes_a_sampled_evaluation_not_a_greedy_one(checkpoint_dir, tmp_path, plays):
  c = config(checkpoint_dir, tmp_path)
  assert c.eval.temperature == 0
  evaluate(c, checkpoint_dir, tmp_path / "a")
  c.seed += 1
  evaluate(c, checkpoint_dir, tmp_path / "b")
  assert plays == [checkpoint_dir]
  c.eval.temperature = 0.5
  evaluate(c, checkpoint_dir, tmp_path / "c")
  c.seed += 1
  evaluate(c, checkpoint_dir, tmp_path / "d")
  assert plays == [checkpoint_dir] * 3


def test_changed_weights_play_the_evaluation_again(checkpoint_dir, tmp_path, plays):
  c = config(checkpoint_dir, tmp_path)
  policy = shutil.copytree(checkpoint_dir, tmp_path / "policy")
  evaluate(c, policy, tmp_path / "a")
  weights = policy / "model.safetensors"
  data = bytearray(weights.read_bytes())
  data[-1] ^= 1
  weights.write_bytes(bytes(data))
  evaluate(c, policy, tmp_path / "b")
  assert plays == [str(policy)] * 2


def test_an_empty_cache_dir_turns_the_cache_off(checkpoint_dir, tmp_path, plays):
  c = config(checkpoint_dir, tmp_path)
  c.eval.cache_dir = ""
  evaluate(c, checkpoint_dir, tmp_path / "a")
  evaluate(c, checkpoint_dir, tmp_path / "b")
  assert plays == [checkpoint_dir] * 2
  assert not (tmp_path / "evaluation_cache").exists()


def test_a_cache_dir_that_is_a_file_is_refused(tmp_path):
  c = config_lib.base_config()
  (tmp_path / "file").write_text("")
  c.eval.cache_dir = str(tmp_path / "file")
  check_config(c, r"eval.cache_dir='.*file' is a file, not a directory")
