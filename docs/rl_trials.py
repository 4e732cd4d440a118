"""Prints the table of the RL recipe trials under a directory (docs/rl_trials.sh): per trial its
config overrides, held-out success of the warm start and of the RL policy (depth 1, depth 2,
all), the goals gained and lost, the exact paired sign test's p-value, and its wall time; then,
from the trajectory logs, each step's replies without an Action line (a turn the environment
cannot execute), over the step's replies, and those of the held-out transcripts when a trial
has them (NAME/transcripts/STAGE: `launch/evaluate.py --trajectories`); and what the training
episodes gave GRPO to learn from: per goal category, the episodes solved of those played, and
the groups (a task's samples in a step) whose rewards differ, the only ones with a signal.

  python docs/rl_trials.py runs/trials
"""

import json
import pathlib
import sys

from agentgym_jax import evaluation


def row(trial: pathlib.Path) -> str | None:
  evaluations = trial / "evaluation"
  if not (evaluations / "rl.json").exists():
    return None
  warm, rl = (
      json.loads((evaluations / f"{stage}.json").read_text()) for stage in ("warm_start", "rl"))
  args = (trial / "args.txt").read_text().split() if (trial / "args.txt").exists() else []
  seconds = (trial / "seconds").read_text().strip() if (trial / "seconds").exists() else "?"
  cells = []
  for summary in (warm, rl):
    depths = [summary["categories"].get(name, {}).get("avg@k") for name in ("depth1", "depth2")]
    cells.append(" / ".join("-" if d is None else f"{100 * d:.1f}" for d in depths) +
                 f" / **{100 * summary['avg@k']:.1f}**")
  paired = evaluation.compare(warm, rl)
  overrides = " ".join(a.replace("--config.", "") for a in args) or "(the first command)"
  minutes = f"{int(seconds) / 60:.0f}" if seconds.isdigit() else seconds
  return (
      f"| {trial.name} | {overrides} | {cells[0]} | {cells[1]} | +{paired.gained} -{paired.lost}"
      f" | {float(paired.p_value):.3f} | {minutes} |")


def actionless(files: list[pathlib.Path]) -> str:
  """"k/n": the assistant replies in the trajectory `files` without an Action line, of all."""
  found = [
      "Action:" not in message["content"] for path in files
      for line in path.read_text().splitlines() for message in json.loads(line)["messages"]
      if message["role"] == "assistant"
  ]
  return f"{sum(found)}/{len(found)}"


def format_row(trial: pathlib.Path) -> str | None:
  steps = sorted((trial / "trajectories").glob("step_*.jsonl"))
  if not steps:
    return None
  held_out = ", ".join(f"{log.name} {actionless(sorted((log / 'trajectories').glob('*.jsonl')))}"
                       for log in sorted((trial / "transcripts").glob("*")))
  return f"| {trial.name} | {' '.join(actionless([path]) for path in steps)} | {held_out or '-'} |"


def signal_row(trial: pathlib.Path) -> str | None:
  """"| trial | depth 1 solved/played | depth 2 solved/played | groups with signal/groups |"
  from the trial's training trajectory logs."""
  steps = sorted((trial / "trajectories").glob("step_*.jsonl"))
  if not steps:
    return None
  solved, played, groups = {}, {}, {}
  for path in steps:
    for line in path.read_text().splitlines():
      episode = json.loads(line)
      category = episode.get("category", "-")
      played[category] = played.get(category, 0) + 1
      solved[category] = solved.get(category, 0) + bool(episode["success"])
      groups.setdefault((episode["step"], episode["group"]), set()).add(episode["reward"])
  cells = [f"{solved.get(c, 0)}/{played.get(c, 0)}" for c in ("depth1", "depth2")]
  with_signal = sum(len(rewards) > 1 for rewards in groups.values())
  return f"| {trial.name} | {' | '.join(cells)} | {with_signal}/{len(groups)} |"


TABLES = (
    ("| trial | overrides | warm start: depth 1 / 2 / all % | RL: depth 1 / 2 / all % | goals | p |"
     " minutes |\n|---|---|---|---|---|---:|---:|", row),
    ("| trial | replies without an Action line, step 1, 2, ... | held-out transcripts |\n"
     "|---|---|---|", format_row),
    ("| trial | training episodes solved, depth 1 | depth 2 | groups with signal |\n"
     "|---|---:|---:|---:|", signal_row),
)


def main(root: str) -> None:
  trials = sorted(path for path in pathlib.Path(root).iterdir() if path.is_dir())
  for index, (header, row_of) in enumerate(TABLES):
    print(("\n" if index else "") + header)
    for line in filter(None, map(row_of, trials)):
      print(line)


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "runs/trials")
