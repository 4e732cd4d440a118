"""A realistic fake run directory (metrics.jsonl + trajectories/) for the viewer and plot tests.

The files follow the trainer's formats (agentgym_jax/metrics.py, rollout.Trajectory.to_json)
and the rough edges a real run has: keys missing or null in some rows, evaluation keys only at
evaluation steps, a metrics line cut short by a crash, trajectories without "env" or
"advantage", environment failures. Message texts carry HTML special characters, a closing
script tag and non-ASCII text so a page that fails to escape them shows it.

Deterministic: the same arguments always write the same bytes.
"""

from __future__ import annotations

import json
import os
import random

ENVS = ("textcraft", "babyai", "sciworld")
# Text a viewer must show literally (never interpret as markup).
SPECIAL_TEXT = '<b>bold?</b> & "quotes" </script><script>window.__pwned = 1</script> naïve café — 日本語 🚀'
# A word found in exactly one trajectory: (step 2, task 1003, sample 1) of the default run.
NEEDLE = "zanzibar-needle"
NEEDLE_AT = (2, 1003, 1)
INSTRUCTIONS = {
    "textcraft": "You are given a few useful crafting recipes to craft items in Minecraft.\n\n"
                 "Reply with\nThought: <your reasoning>\n\nAction: <one command>",
    "babyai": "You are an exploration master that wants to finish every goal you are given.\n\n"
              "Reply with\nThought: ...\n\nAction: ...",
    "sciworld": "You are a helpful agent that interacts with the virtual science school "
                "environment to solve the given task.",
}
ACTIONS = {
    "textcraft": ("get 1 oak log", "craft 4 oak planks using 1 oak log", "inventory"),
    "babyai": ("turn left", "go through blue closed door 1", "pickup red ball 1"),
    "sciworld": ("look around", "focus on thermometer", "move thermometer to inventory"),
}
TERMINATIONS = ("done", "horizon", "context", "env_error", "env_timeout")


def _trajectory(rng: random.Random, step: int, task_id: int, group: int, sample: int) -> dict:
  env = ENVS[task_id % len(ENVS)]
  horizon = 3 + step // 2
  failure = rng.random()
  if failure < 0.06:
    termination = "env_error"
  elif failure < 0.09:
    termination = "env_timeout"
  else:
    termination = rng.choice(("done", "done", "done", "horizon", "context"))
  num_turns = 0 if termination in ("env_error", "env_timeout") and failure < 0.03 else (rng.randint(
      1, horizon))
  success = termination == "done" and rng.random() < 0.3 + 0.1 * step
  turn_rewards = [0.0] * num_turns
  if success:
    turn_rewards[-1] = 1.0
  elif num_turns and env == "sciworld":
    turn_rewards[0] = 0.25  # Partial progress, as SciWorld's score gives.
  messages = [{
      "role": "user", "content": f"{INSTRUCTIONS[env]}\n\nTask {task_id}: you are in a room "
                                 f"with a <chest> & a 'table'."
  }]
  if (step, task_id, sample) == NEEDLE_AT:
    messages[0]["content"] += f" A map of {NEEDLE.upper()} lies here."  # Found case-blind.
  for turn in range(num_turns):
    action = rng.choice(ACTIONS[env])
    thought = f"Step {turn + 1}: I should {action}."
    if turn == 0 and sample == 0:
      thought += " " + SPECIAL_TEXT
    messages.append({"role": "assistant", "content": f"Thought: {thought}\n\nAction: {action}"})
    if turn + 1 < num_turns:  # The last observation of an episode is not logged.
      observation = f"Observation {turn + 1}: nothing happens.\n  x <= y && y > z"
      messages.append({"role": "user", "content": observation})
  record = {
      "task_id": task_id,
      "group": group,
      "sample": sample,
      "reward": sum(turn_rewards),
      "success": success,
      "num_turns": num_turns,
      "termination": termination,
      "error": ("adapter crashed: <ConnectionError> & retries exhausted"
                if termination == "env_error" else ""),
      "turn_rewards": turn_rewards,
      "messages": messages,
      "num_tokens": 40 * (1 + 2 * num_turns),
      "num_trained_tokens": 25 * num_turns,
      "info": {"success": success, "score": sum(turn_rewards) * 100},
  }
  if task_id % 5 != 4:  # Some records lack the optional fields.
    record["env"] = env
    record["category"] = f"depth{1 + task_id % 2}"
  if sample != 3:
    record["advantage"] = round(rng.uniform(-1.5, 1.5), 4)
  return record


def write_fake_run(workdir: str | os.PathLike[str], num_steps: int = 6, tasks_per_step: int = 4,
                   samples_per_task: int = 4, seed: int = 0) -> str:
  """Writes a fake run under `workdir`; returns its path.

  Trajectories are logged for every step; task ids are 1000 + step * tasks_per_step + k.
  Default: 6 steps x 4 tasks x 4 samples = 96 trajectories.
  """
  rng = random.Random(seed)
  workdir = os.fspath(workdir)
  os.makedirs(os.path.join(workdir, "trajectories"), exist_ok=True)
  metric_lines = []
  for step in range(num_steps):
    records = [
        _trajectory(rng, step, 1000 + (step * tasks_per_step + k) % 8, k, sample)
        for k in range(tasks_per_step) for sample in range(samples_per_task)
    ]
    with open(os.path.join(workdir, "trajectories", f"step_{step:06d}.jsonl"), "w",
              encoding="utf-8") as f:
      for record in records:
        f.write(json.dumps({"step": step, **record}, ensure_ascii=False) + "\n")
    count = len(records)
    row = {
        "step": step,
        "time": 1.7e9 + 60.0 * step,
        "reward": sum(r["reward"] for r in records) / count,
        "success": sum(r["success"] for r in records) / count,
        "turns": sum(r["num_turns"] for r in records) / count,
        "horizon_cap": 3 + step // 2,
        "horizon_stage": step // 2,
        "tokens_per_s": 900.0 + 40.0 * step,
        "entropy": 1.2 - 0.1 * step,
        "kl_to_ref": 0.002 * step,
        "grad_norm": 0.8 + 0.05 * step,
        "logprob_gap_mean": 0.001,
        "policy/clip_fraction": 0.02 * step,
        "loss": 0.3 - 0.02 * step,
        "time/rollout": 20.0 + step,
        "time/experience": 3.0,
        "time/update": 8.0,
    }
    for termination in TERMINATIONS:
      row[f"termination/{termination}"] = sum(
          r["termination"] == termination for r in records) / count
    if step == 1:
      del row["entropy"]  # A key missing from one row...
      row["kl_to_ref"] = None  # ...and a non-finite value logged as null.
    if step % 2 == 1:  # Evaluations every other step, per category.
      row.update({
          "eval/success": 0.2 + 0.1 * step, "eval/success/depth1": 0.3 + 0.1 * step,
          "eval/success/depth2": 0.1 + 0.05 * step
      })
    metric_lines.append(json.dumps(row) + "\n")
  with open(os.path.join(workdir, "metrics.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(metric_lines)
    f.write('{"step": %d, "time": 1.7e9, "rew' % num_steps)  # Cut short by a crash.
  return workdir


def read_fake_trajectories(workdir: str | os.PathLike[str]) -> list[dict]:
  """Every trajectory record of a fake run, in step then file order."""
  directory = os.path.join(os.fspath(workdir), "trajectories")
  records = []
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), encoding="utf-8") as f:
      records.extend(json.loads(line) for line in f)
  return records
