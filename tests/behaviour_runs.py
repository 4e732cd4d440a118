"""The behaviour of a source tree, as metrics: four tiny runs, each stopped after 2 steps and
resumed to 4, whose metrics (wall-clock figures left out) a restructuring must leave
byte-identical (tests/test_behaviour_unchanged.py runs this at a reference commit and at the
working tree and compares).

  python tests/behaviour_runs.py OUT_DIR    # writes OUT_DIR/{grpo_kl,ppo_gae,sft,dpo}.jsonl

The runs: GRPO with a KL loss and PPO with GAE (value head) on 2-turn echo, SFT on echo
conversations and DPO on preference pairs of them, all with tests/tiny.py's random model on one
device in f32. It uses only what every version of the project offers: config.base_config,
trainer.train (RL), offline.train_offline (SFT, DPO) and metrics.jsonl; the source tree is the
one on PYTHONPATH.
"""

import json
import os
import pathlib
import sys
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import tiny  # pylint: disable=wrong-import-position
from agentgym_jax import config as config_lib  # pylint: disable=wrong-import-position
from agentgym_jax import offline, trainer  # pylint: disable=wrong-import-position

RUNS = ("grpo_kl", "ppo_gae", "sft", "dpo")
# Keys that measure the machine, not the computation: stamps, durations, rates.
WALL_CLOCK = {"time", "tokens_per_s", "rollout/env_hidden_fraction"}


def _conversation(*turns):
  roles = ("user", "assistant")
  return [{"role": roles[i % 2], "content": content} for i, content in enumerate(turns)]


def _write_data(directory: pathlib.Path) -> dict[str, pathlib.Path]:
  """An SFT file of echo conversations and a DPO file of (successful, failed) reply pairs."""
  sft = [
      _conversation(prompt, reply)
      for prompt, reply in (("1 0", "1 0"), ("0 0", "0 0"), ("1 1", "1 1"), ("0 1", "0 1"))
  ]
  pairs = (("1 0", "1 0", "0 1"), ("0 0", "0 0", "1"), ("1 1", "1 1", "0"), ("0 1", "0 1", "1 0"))
  dpo = [{
      "task_id": task, "env": "echo", "messages": _conversation(prompt, reply), "reward": float(ok),
      "success": ok, "num_turns": 1
  } for task, (prompt, chosen, rejected) in enumerate(pairs)
         for reply, ok in ((chosen, True), (rejected, False))]
  paths = {"sft": directory / "sft.jsonl", "dpo": directory / "dpo.jsonl"}
  for name, records in (("sft", [{"messages": m} for m in sft]), ("dpo", dpo)):
    paths[name].write_text("".join(json.dumps(r) + "\n" for r in records))
  return paths


def run_config(name: str, checkpoint: pathlib.Path, data: dict[str, pathlib.Path]):
  """The config of the run `name` (one of RUNS), 4 steps, checkpointed every 2."""
  c = config_lib.base_config()
  c.seed = 0
  c.model.name = str(checkpoint)
  config_lib.tiny_echo(c)
  c.env.options.turns = 2
  c.rollout.max_context = 64
  c.horizon.kind = "fixed"
  c.horizon.turns = 2
  if name == "grpo_kl":
    c.algorithm.kl_coef = 0.01
  elif name == "ppo_gae":
    c.algorithm.advantage = "gae"
  else:
    c.mode = name
    c.data.path = str(data[name])
    c.data.batch_size = 2
    c.data.max_length = 32
    c.algorithm.logprob_chunk = 16
  c.steps = 4
  c.checkpoint.every = 2
  return c


def behaviour(name: str, checkpoint: pathlib.Path, data: dict[str, pathlib.Path],
              workdir: pathlib.Path) -> str:
  """The run's metrics.jsonl after 2 steps and a resume to 4, without wall-clock figures, as
  sorted JSON lines."""
  c = run_config(name, checkpoint, data)
  train = trainer.train if c.mode == "rl" else offline.train_offline
  c.steps = 2
  train(c, workdir)
  c.steps = 4
  train(c, workdir)
  lines = []
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    record = {
        k: v for k, v in json.loads(line).items()
        if k not in WALL_CLOCK and not k.startswith("time/")
    }
    lines.append(json.dumps(record, sort_keys=True) + "\n")
  return "".join(lines)


def main(out: str) -> None:
  print(f"source tree: {pathlib.Path(trainer.__file__).parents[1]}", flush=True)
  out_dir = pathlib.Path(out)
  out_dir.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as scratch:
    scratch = pathlib.Path(scratch)
    checkpoint = tiny.make_checkpoint(scratch / "tiny")
    data = _write_data(scratch)
    for name in RUNS:
      text = behaviour(name, checkpoint, data, scratch / name)
      (out_dir / f"{name}.jsonl").write_text(text)


if __name__ == "__main__":
  main(*sys.argv[1:])
