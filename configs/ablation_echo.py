r"""A quick ScalingInter-RL ablation: three horizon schedules on a 4-turn echo task.

The task (environments/echo.py, turns=4): repeat the symbol shown, four turns in a row; the
only reward is 1 at the end of an all-correct episode, and a wrong answer ends the episode.
The variants differ only in the turn cap of the rollouts:

  short    fixed cap 2: below the task's length, so no episode can earn a reward
  long     fixed cap 4: every episode can finish from the first step
  scaling  stepwise caps (2, 4), raised at a third of the run (ScalingInter-RL's staged
           horizon: short interactions first, then the full horizon)

What this toy can show: that a cap below the length of the task gives no outcome reward, hence
no policy gradient (GRPO's group-normalised advantage of all-zero rewards is zero), so the
short run never learns; and what the staged schedule pays for its short stage on a task with
no partial credit (learning starts only once the cap reaches the task's length). What it
cannot show: the paper's gain of the staged schedule over a long horizon from the start. That
gain comes from tasks that the short cap can already solve (the short stage learns them
stably) and from long, aimless trajectories destabilising early training; echo has a single
task length and ends an episode at the first wrong answer, so a long cap adds no noisy long
trajectories and a cap above 4 is the same as 4.

`c.model.name` must be set by the caller to a Hugging Face checkpoint directory whose tokenizer
makes the symbols '0' and '1' single tokens, e.g. the tiny random model of tests/tiny.py (as
notebooks/scalinginter_ablation.ipynb does):

  python launch/train.py --config=configs/ablation_echo.py:scaling --workdir=runs/echo_scaling \
      --config.model.name=/path/to/tiny_checkpoint --config.mesh.fsdp=1
"""

from agentgym_jax.config import base_config, tiny_echo

TURNS = 4
VARIANTS = ("short", "long", "scaling")


def get_config(variant: str = "scaling"):
  c = base_config()
  c.steps = 30
  c.model.name = ""  # Set by the caller: a checkpoint directory (see the module docstring).
  # Plain GRPO with a large step size (a step this large can also undo what it learnt).
  tiny_echo(c)
  c.env.options.turns = TURNS
  c.rollout.max_context = 128  # Instruction plus four turns of ~10 tokens each.
  if variant == "short":
    c.horizon.kind = "fixed"
    c.horizon.turns = TURNS // 2
  elif variant == "long":
    c.horizon.kind = "fixed"
    c.horizon.turns = TURNS
  elif variant == "scaling":
    c.horizon.kind = "stepwise"
    c.horizon.caps = (TURNS // 2, TURNS)
    c.horizon.every = c.steps // 3  # Callers that change c.steps set this too.
  else:
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
  return c
