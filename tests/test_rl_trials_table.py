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
