"""docs/rl_trials.py, which prints the recipe trials' tables: the replies without an Action line
counted per step from the trajectory logs, and per held-out transcript."""

import importlib.util
import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load():
  spec = importlib.util.spec_from_file_location("rl_trials", REPO / "docs" / "rl_trials.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _log(path: pathlib.Path, replies_per_trajectory):
  path.parent.mkdir(parents=True, exist_ok=True)
  lines = []
  for replies in replies_per_trajectory:
    messages = [{"role": "user", "content": "Goal: craft sugar."}]
    for reply in replies:
      messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
    lines.append(json.dumps({"task_id": 507, "messages": messages}))
  path.write_text("\n".join(lines) + "\n")


def test_replies_without_an_action_are_counted_per_step_and_per_transcript(tmp_path):
  trials = _load()
  acting = "Thought: I get it.\n\nAction: get 1 sugar cane"
  silent = "Thought: I have everything for the goal, so I craft it to reach it."
  trial = tmp_path / "fixed8"
  _log(trial / "trajectories" / "step_000001.jsonl", [[acting, acting], [acting]])
  _log(trial / "trajectories" / "step_000002.jsonl", [[acting, silent, silent], [silent]])
  _log(trial / "transcripts" / "rl_depth1" / "trajectories" / "step_000000.jsonl",
       [[silent, acting]])
  assert trials.format_row(trial) == "| fixed8 | 0/3 3/4 | rl_depth1 1/2 |"
  assert trials.format_row(tmp_path / "no_logs") is None


def test_training_episodes_are_counted_per_category_and_groups_with_signal(tmp_path):
  trials = _load()
  trial = tmp_path / "staged"
  (trial / "trajectories").mkdir(parents=True)

  def episode(step, group, category, reward):
    return json.dumps({
        "step": step, "group": group, "category": category, "reward": reward, "success": reward > 0,
        "messages": []
    })

  # Step 1: group 0 mixed (signal), group 1 all failed; step 2: one depth-2 group, all failed.
  (trial / "trajectories" / "step_000001.jsonl").write_text("\n".join([
      episode(1, 0, "depth1", 1.0),
      episode(1, 0, "depth1", 0.0),
      episode(1, 1, "depth1", 0.0),
      episode(1, 1, "depth1", 0.0)
  ]) + "\n")
  (trial / "trajectories" / "step_000002.jsonl").write_text("\n".join(
      [episode(2, 0, "depth2", 0.0), episode(2, 0, "depth2", 0.0)]) + "\n")
  assert trials.signal_row(trial) == "| staged | 1/4 | 0/2 | 1/3 |"
  assert trials.signal_row(tmp_path / "no_logs") is None
