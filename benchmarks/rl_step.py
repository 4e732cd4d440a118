"""Where an RL step's time goes: generation, environment, experience and update.

  python benchmarks/rl_step.py                                   # SmolLM2-135M on TextCraft
  python benchmarks/rl_step.py --env=echo --model=tiny           # the test model, seconds
  python benchmarks/rl_step.py --quick                           # 2 tasks x 2 samples, 2 turns
  python benchmarks/rl_step.py --env=echo --env_delay_ms=200     # a slow env: G=1 vs G=2
  python benchmarks/rl_step.py --vs=bf7a2af --turns=3            # this tree against a commit
  python benchmarks/rl_step.py --pipeline_groups=1 --shared_prompts=on,off   # the learner's
                                                  # packed groups against one row a sample
  python benchmarks/rl_step.py --mode=sync,stream,async --step_latency_s=0.3 \
      --model=runs/local/warm_start/export --turns=8   # lock-step, refilled rows, async RL
  python benchmarks/rl_step.py --mode=sync,stream,stream:16 --model=EXPORT --turns=8
                                                  # whole replies a decode call, or 16 tokens

Runs `trainer.train` for --steps steps of the configured size (a temporary workdir, no
checkpoints) and reads its per-step metrics:
  rollout     time/rollout: the whole multi-turn rollout, of which
    generate  time/generate: the device generating (each decode call until its output is ready);
    env       time/env: the env pool's reset and step calls (the rollout's env_s);
    other     rollout - generate - env + hidden (the time neither was busy): prefills of
              prompts and observations, tokenizing, detokenizing and bookkeeping on the host;
  experience  time/experience: packing and the old/reference log-probs + advantages;
  update      time/update: the optimizer steps (ppo_epochs x num_minibatches).
"phases" is rollout + experience + update. The trainer's phase timers do not wait for the
device, so a phase ends when its work is dispatched and device work spills into the next timed
phase (the experience's log-probs finish inside update's first call) or past the last one.
"step" is therefore the wall time between consecutive metrics rows (whose writing fetches every
result of the step), the phase sum for the first step; fractions are of "step". tokens/s is generated tokens per second of
generation (the trainer's tokens_per_s) and per second of the whole step.

Overlap. Each run of --pipeline_groups (default 1 and 2, side by side in one call) trains
with rollout.pipeline_groups = G: the step's rows are split into G groups whose env steps run
while the other groups decode. time/generate is then the time the device was generating and
time/env the time the pool was busy; "hidden" is the env time during which generation was in
flight too (time/env_hidden, as a fraction of the step and of env). "hideable" bounds what a
perfect overlap could save: min(env, step - env); "step if hidden" is the step minus that.
--env_delay_ms makes every echo step sleep, standing in for a slow simulator or a remote env:
on a small CPU host the env pool's threads compete with XLA's for the cores, so sleeping envs
show the mechanism best (a CPU-bound env hides less there; on an accelerator host it would not
compete with the device).

Against a commit (--vs=REV). Both sides run --recipe (default configs/grpo_textcraft.py:local,
each tree's own version of it: its dtype, remat, cache and loss settings) at --tasks x
--samples and a fixed cap of --turns, one after the other in fresh processes, the commit from a
temporary git worktree (benchmarks/rl_step_side.py imports that tree's package); the phase
tables of both and the speed-up of each phase follow.

Shared prompts. Each value of --shared_prompts (default on) trains with
algorithm.shared_prompts: "on" packs each task's samples as one row for the experience pass and
the update (agentgym_jax/batch.py), "off" runs one row a sample. Both play the same first step;
after it their policies differ by the update's float rounding, which can flip a sampled token
and so the later episodes (gen tokens and turns show it). Every pair (pipeline groups, shared
prompts) is one run, in the order given.

Modes (--mode, a list; runs side by side, each at --pipeline_groups' first value and
--shared_prompts' first): the step's episodes on --wave_rows rows (default half the step's), as
  sync    lock-step waves, each waiting for its longest episode (rollout.refill=False);
  stream  continuous batching: a row whose episode ends takes the next (rollout.refill);
  async   stream, played one update ahead of the learner (rollout.max_staleness=1, decoupled
          PPO's correction): the learner's step no longer waits for the rollout's.
A mode may name a decode chunk, e.g. stream:16 (rollout.decode_chunk=16): each decode call
samples up to 16 tokens of a reply, and a row whose reply ends starts its next reply as soon
as its env step is back, instead of waiting for the last reply of its round.
--step_latency_s adds a drawn time to every env step of any environment (env.latency: log-normal
of that mean, sigma 0.9, capped at 3 s), standing in for a simulator, browser or remote env. The
table gives each mode's step wall time (between consecutive metrics rows, so an async step is
what the learner waited plus its own work), episodes and env turns per minute (turns compare
equal work where the modes' episodes end at different turns), the idle row fraction and the
time of each phase.

The first step compiles every program (the sampler's prefill and decode, the learner's
experience and update) and is reported apart; the means are over the later steps.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
from typing import Any

from absl import app
from absl import flags

import jax
import numpy as np

from agentgym_jax import config as config_lib
from agentgym_jax import hardware, trainer

REPO = pathlib.Path(__file__).resolve().parent.parent

_ENV = flags.DEFINE_enum("env", "textcraft", ["textcraft", "echo"], "Environment.")
_MODEL = flags.DEFINE_string(
    "model", "smollm2-135m-instruct",
    "Registry name, HF checkpoint directory, or 'tiny' (tests/tiny.py's random 2-layer model).")
_DTYPE = flags.DEFINE_enum("dtype", "auto", config_lib.DTYPES + ("auto",),
                           "Matmul dtype (auto: bf16 where the hardware runs it fast).")
_REMAT = flags.DEFINE_enum("remat", "none", ["none", "full", "dots"], "Remat policy.")
_STEPS = flags.DEFINE_integer("steps", 3, "RL steps, the first of them the warm-up.")
_TASKS = flags.DEFINE_integer("tasks", 4, "Tasks per step (--quick: 2).")
_SAMPLES = flags.DEFINE_integer("samples", 4, "Samples per task (--quick: 2).")
_TURNS = flags.DEFINE_integer("turns", 4, "Horizon: turns per episode (--quick: 2).")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per turn (--quick: 32).")
_CONTEXT = flags.DEFINE_integer("max_context", 2048, "Tokens per trajectory.")
_QUICK = flags.DEFINE_bool("quick", False, "A small run: 2 x 2 rollouts, 2 turns, 32 tokens.")
_GROUPS = flags.DEFINE_list("pipeline_groups", ["1", "2"],
                            "rollout.pipeline_groups of each run, compared side by side.")
_ENV_DELAY_MS = flags.DEFINE_integer("env_delay_ms", 0, "Sleep per echo env step (--env=echo).")
_VS = flags.DEFINE_string(
    "vs", None, "A git commit: run --recipe at this size in this tree and in a worktree of the "
    "commit, one after the other, and compare the two steps phase by phase.")
_RECIPE = flags.DEFINE_string("recipe", "configs/grpo_textcraft.py:local",
                              "The config file and variant each side of --vs runs.")
_SET = flags.DEFINE_multi_string(
    "set", [], "key=value set on both sides of --vs after the benchmark's own keys (a JSON "
    "value, or else a string), e.g. --set=model.name=/path/to/checkpoint.")
_SHARED = flags.DEFINE_list("shared_prompts", ["on"],
                            "algorithm.shared_prompts of each run (on, off), side by side.")
_MODES = flags.DEFINE_list(
    "mode", [], "Rollout modes side by side: sync, stream, async, each with an optional "
    ":CHUNK (rollout.decode_chunk), e.g. stream:16.")
_WAVE_ROWS = flags.DEFINE_integer("wave_rows", 0, "Rows of --mode runs (0: half the step's).")
_LATENCY = flags.DEFINE_float("step_latency_s", 0.0,
                              "Mean added time of every env step (0: none); env.latency.")
MODES = ("sync", "stream", "async")

PHASES = ("rollout", "generate", "env", "other", "experience", "update")
# What the summary rows average: the steps after the warm-up, or the warm-up alone (--steps=1).
MEANS = ("The warm-up step alone (--steps=1: its times include compiling).",
         "Means over the steps after the warm-up.")


def make_config(model: str, groups: int, shared_prompts: bool) -> Any:
  c = config_lib.base_config()
  quick = _QUICK.value
  c.steps = _STEPS.value
  c.model.name = model
  c.model.dtype = _DTYPE.value
  c.model.remat = _REMAT.value
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.env.name = _ENV.value
  if _ENV.value == "echo":
    c.env.options.turns = 2 if quick else _TURNS.value
    c.env.options.step_delay_s = _ENV_DELAY_MS.value / 1000
  c.rollout.tasks_per_step = 2 if quick else _TASKS.value
  c.rollout.samples_per_task = 2 if quick else _SAMPLES.value
  c.rollout.max_new_tokens = 32 if quick else _NEW_TOKENS.value
  c.rollout.max_context = _CONTEXT.value
  c.horizon.kind = "fixed"
  c.horizon.turns = 2 if quick else _TURNS.value
  c.rollout.pipeline_groups = groups
  c.algorithm.num_minibatches = 2
  c.algorithm.shared_prompts = shared_prompts
  c.env.latency.mean_s = _LATENCY.value
  config_lib.quiet(c)
  return c


def parse_mode(mode: str) -> tuple[str, int]:
  """A --mode entry: its name (MODES) and decode chunk (0: whole replies)."""
  name, _, chunk = mode.partition(":")
  if name not in MODES or not (chunk.isdigit() or not chunk):
    raise app.UsageError(f"--mode takes {', '.join(MODES)}, each with an optional :CHUNK "
                         f"(e.g. stream:16), not {mode!r}")
  return name, int(chunk or 0)


def set_mode(c: Any, mode: str) -> int:
  """Sets rollout `mode` (MODES, with an optional :CHUNK) on `c`; returns its wave rows."""
  mode, c.rollout.decode_chunk = parse_mode(mode)
  rows = c.rollout.tasks_per_step * c.rollout.samples_per_task
  c.rollout.wave_rows = _WAVE_ROWS.value or max(rows // 2, 1)
  c.rollout.refill = mode != "sync"
  if mode == "async":
    c.rollout.max_staleness = 1
    c.algorithm.rollout_correction = "decoupled"
  return c.rollout.wave_rows


def compare_modes(model: str, directory: pathlib.Path) -> None:
  """--mode: each rollout mode's run, one after the other; their step tables, then one row a
  mode with the ratios to the first."""
  results = {}
  for mode in _MODES.value:
    c = make_config(model, int(_GROUPS.value[0]), _SHARED.value[0] == "on")
    wave = set_mode(c, mode)
    print(f"\nmode {mode}: model {_MODEL.value} ({c.model.dtype}), env {c.env.name}"
          f"{f' with {_LATENCY.value} s mean step latency' if _LATENCY.value else ''}, "
          f"{c.rollout.tasks_per_step} tasks x {c.rollout.samples_per_task} samples on {wave} "
          f"rows, {c.horizon.turns} turns x {c.rollout.max_new_tokens} new tokens")
    history = trainer.train(c, directory / f"run_{mode}")
    seconds, row = print_steps(history)
    later = history[1:] or history
    for part in ("idle_row_fraction", "idle_rows/no_episode", "idle_rows/env_step"):
      row[part] = float(np.mean([r[f"rollout/{part}"] for r in later]))
    results[mode] = (seconds, row, c.rollout.tasks_per_step * c.rollout.samples_per_task)
  print("\n| mode | step s | episodes / min | vs first | turns / min | vs first | rollout s (wait) "
        "| generate s | env s | idle rows | no episode | env step | experience s | update s | "
        "turns |")
  print("|" + "---|" * 15)
  first_seconds, first_row, _ = next(iter(results.values()))
  first, first_turns = first_seconds["step"], first_row["turns"]
  for mode, (seconds, row, episodes) in results.items():
    print(f"| {mode} | {seconds['step']:.2f} | {60 * episodes / seconds['step']:.1f} | "
          f"{first / seconds['step']:.2f}x | "
          f"{60 * episodes * row['turns'] / seconds['step']:.1f} | "
          f"{first * row['turns'] / (seconds['step'] * first_turns):.2f}x | "
          f"{seconds['rollout']:.2f} | {seconds['generate']:.2f} "
          f"| {seconds['env']:.2f} | {row['idle_row_fraction']:.1%} | "
          f"{row['idle_rows/no_episode']:.1%} | {row['idle_rows/env_step']:.1%} | "
          f"{seconds['experience']:.2f} | "
          f"{seconds['update']:.2f} | {row['turns']:.2f} |")
  print(f"\n{MEANS[_STEPS.value > 1]} idle rows: the share of decode row-steps that "
        "generated nothing (rollout/idle_row_fraction), of which no episode: rows with no "
        "episode left to start, env step: rows waiting for their env step (the rest: replies "
        "that ended before the last of their call). An async step's rollout s is the "
        "learner's wait for a rollout played during the updates before it. Turns / min counts "
        "the env turns played: where the modes' policies part and their episodes end at "
        "different turns, it compares equal work where episodes / min does not.")


def phase_seconds(row: dict[str, Any]) -> dict[str, float]:
  out = {
      name: float(row.get(f"time/{name}", 0.0))
      for name in ("rollout", "generate", "env", "env_hidden", "experience", "update")
  }
  out["other"] = out["rollout"] - out["generate"] - out["env"] + out["env_hidden"]
  out["phases"] = out["rollout"] + out["experience"] + out["update"]
  out["step"] = out["phases"]
  return out


def main(argv):
  del argv
  if _ENV_DELAY_MS.value and _ENV.value != "echo":
    raise app.UsageError("--env_delay_ms needs --env=echo")
  if not set(_SHARED.value) <= {"on", "off"}:
    raise app.UsageError(f"--shared_prompts takes on and off, not {_SHARED.value}")
  for mode in _MODES.value:
    parse_mode(mode)
  print("command: " + " ".join([os.path.basename(sys.executable)] + sys.argv))
  print(hardware.describe())
  print(f"host: {platform.node()}, {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, jax {jax.__version__} "
        f"({jax.devices()[0].platform}, {jax.device_count()} devices)")
  if _VS.value:
    compare_commits(_VS.value)
    return
  means = {}
  with tempfile.TemporaryDirectory() as directory:
    model = _MODEL.value
    if model == "tiny":
      sys.path.insert(0, str(REPO / "tests"))
      import tiny  # pylint: disable=g-import-not-at-top

      model = str(tiny.make_checkpoint(pathlib.Path(directory) / "tiny"))
    if _MODES.value:
      compare_modes(model, pathlib.Path(directory))
      return
    for groups in map(int, _GROUPS.value):
      for shared in _SHARED.value:
        c = make_config(model, groups, shared == "on")
        print(f"\nmodel {_MODEL.value} ({c.model.dtype}, remat {c.model.remat}), env "
              f"{c.env.name}"
              f"{f' sleeping {_ENV_DELAY_MS.value} ms a step' if _ENV_DELAY_MS.value else ''}, "
              f"{c.rollout.tasks_per_step} tasks x {c.rollout.samples_per_task} samples, "
              f"{c.horizon.turns} turns x {c.rollout.max_new_tokens} new tokens, "
              f"{c.algorithm.num_minibatches} minibatches, pipeline_groups {groups}, "
              f"shared prompts {shared}")
        history = trainer.train(c, pathlib.Path(directory) / f"run_g{groups}_{shared}")
        means[groups, shared] = print_steps(history)

  print("\n| pipeline groups | shared prompts | step s | rollout s | generate s | env s | "
        "env hidden | tokens/s (gen) | turns | rollout vs first | experience s | update s | "
        "learner vs first |")
  print("|" + "---|" * 13)
  first_seconds = next(iter(means.values()))[0]
  learner_seconds = lambda seconds: seconds["experience"] + seconds["update"]
  for (groups, shared), (seconds, row) in means.items():
    print(f"| {groups} | {shared} | {seconds['step']:.2f} | {seconds['rollout']:.2f} | "
          f"{seconds['generate']:.2f} | {seconds['env']:.2f} | "
          f"{row['rollout/env_hidden_fraction']:.1%} | {row['tokens_per_s']:.0f} | "
          f"{row['turns']:.2f} | {first_seconds['rollout'] / seconds['rollout']:.2f}x | "
          f"{seconds['experience']:.2f} | {seconds['update']:.2f} | "
          f"{learner_seconds(first_seconds) / learner_seconds(seconds):.2f}x |")
  print(f"\n{MEANS[_STEPS.value > 1]} env hidden: the fraction of env time spent "
        "while the device was generating. Runs of one shared_prompts value play the same "
        "episodes (each row samples from its own key), so gen tokens and turns agree step by "
        "step; shared and unshared runs agree on the first step (see the module docstring). "
        "learner: experience + update.")


def recipe_spec() -> dict[str, Any]:
  """What each side of --vs runs: --recipe at the benchmark's size, one fixed turn cap over the
  recipe's tasks (no curriculum), writing nothing but metrics."""
  return {
      "config": _RECIPE.value, "set": {
          "steps": _STEPS.value,
          "rollout.tasks_per_step": _TASKS.value,
          "rollout.samples_per_task": _SAMPLES.value,
          "rollout.curriculum": [],
          "horizon.kind": "fixed",
          "horizon.turns": _TURNS.value,
          "checkpoint.every": 0,
          "checkpoint.export_hf": False,
          "eval.stages": False,
          "log.tensorboard": False,
          "log.trajectories": False,
          "log.progress_bar": False,
      } | dict(_parse_setting(setting) for setting in _SET.value)
  }


def _parse_setting(setting: str) -> tuple[str, Any]:
  key, sep, value = setting.partition("=")
  if not sep:
    raise app.UsageError(f"--set={setting!r} must read key=value")
  try:
    return key, json.loads(value)
  except json.JSONDecodeError:
    return key, value


def run_side(tree: pathlib.Path, spec: dict[str, Any], directory: pathlib.Path) -> dict[str, Any]:
  """Runs benchmarks/rl_step_side.py on `tree` in a fresh process; returns its output."""
  (directory / "spec.json").write_text(json.dumps(spec))
  out = directory / f"{tree.name}.json"
  subprocess.run([
      sys.executable,
      str(REPO / "benchmarks" / "rl_step_side.py"),
      str(tree),
      str(directory / "spec.json"),
      str(out)
  ], check=True, cwd=tree)
  return json.loads(out.read_text())


def compare_commits(commit: str) -> None:
  """--vs: the recipe's RL step in this tree and in a worktree of `commit`, one after the other
  in this invocation; both phase tables, then the ratios."""
  spec = recipe_spec()
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                        text=True, check=True).stdout.strip()
  print(f"\n{spec['config']}, {_TASKS.value} tasks x {_SAMPLES.value} samples, {_TURNS.value} "
        f"turns, {_STEPS.value} steps (the first is the warm-up), each side its own recipe")
  results = {}
  with tempfile.TemporaryDirectory() as directory:
    directory = pathlib.Path(directory)
    baseline = directory / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach",
                    str(baseline), commit], cwd=REPO, check=True, capture_output=True)
    try:
      for name, tree in ((f"this tree ({head})", REPO), (f"commit {commit}", baseline)):
        results[name] = run_side(tree, spec, directory)
    finally:
      subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=REPO, check=True)
  means = {}
  for name, result in results.items():
    c = result["config"]
    print(f"\n{name}: model.dtype {c['model']['dtype']}, remat {c['model']['remat']}, "
          f"attention {c['model'].get('attention', 'dense')}, cache "
          f"{c['rollout'].get('cache_dtype', '-')}, kl_coef {c['algorithm']['kl_coef']}, "
          f"{c['algorithm']['num_minibatches']} minibatches"
          f"{'; not in this tree: ' + ', '.join(result['skipped']) if result['skipped'] else ''}")
    means[name] = print_steps(result["history"])
  (ours, _), (theirs, _) = means.values()
  print("\n| phase | " + " | ".join(f"{name} s" for name in means) + " | speed-up |")
  print("|---|---:|---:|---:|")
  for phase in ("step", "rollout", "generate", "env", "experience", "update"):
    print(f"| {phase} | {ours[phase]:.2f} | {theirs[phase]:.2f} | "
          f"{theirs[phase] / max(ours[phase], 1e-9):.2f}x |")


def print_steps(history: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, float]]:
  """Prints one row per step; returns the mean phase seconds and metrics after the warm-up."""
  print()
  print("| step | " + " | ".join(f"{p} s" for p in PHASES) + " | phases s | step s | env / step "
        "| hidden | hideable | step if hidden | gen tokens | tokens/s (gen) | tokens/s (step) "
        "| turns | reward |")
  print("|" + "---|" * (len(PHASES) + 12))
  measured = []
  for index, row in enumerate(history):
    seconds = phase_seconds(row)
    if index > 0:
      seconds["step"] = row["time"] - history[index - 1]["time"]
    label = f"{index + 1} (warm-up)" if index == 0 and len(history) > 1 else str(index + 1)
    if index > 0 or len(history) == 1:
      measured.append((seconds, row))
    print(_row(label, seconds, row))
  mean_seconds = {k: float(np.mean([s[k] for s, _ in measured])) for k in measured[0][0]}
  mean_row = {
      k: float(np.mean([r[k] for _, r in measured]))
      for k in ("tokens_generated", "tokens_per_s", "turns", "reward",
                "rollout/env_hidden_fraction")
  }
  print(_row("mean", mean_seconds, mean_row))
  return mean_seconds, mean_row


def _row(label: str, seconds: dict[str, float], row: dict[str, Any]) -> str:
  step, env = seconds["step"], seconds["env"]
  hideable = min(env, step - env)
  cells = [label] + [f"{seconds[p]:.2f}" for p in PHASES] + [
      f"{seconds['phases']:.2f}", f"{step:.2f}", f"{env / step:.1%}",
      f"{seconds['env_hidden'] / step:.1%}", f"{hideable / step:.1%}", f"{step - hideable:.2f}",
      f"{row['tokens_generated']:.0f}", f"{row['tokens_per_s']:.0f}",
      f"{row['tokens_generated'] / step:.0f}", f"{row['turns']:.2f}", f"{row['reward']:.2f}"
  ]
  return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
  app.run(main)
