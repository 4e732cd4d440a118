r"""GRPO against GiGPO on a 3-turn echo task: the same runs but for the advantage estimator.

The task (environments/echo.py, turns=3): repeat the symbol shown, three turns in a row; the
only reward is 1 at the end of an all-correct episode, and a wrong answer ends the episode.
The two variants share everything else (fixed cap of 3 turns, plain settings of `tiny_echo`):

  grpo   episode-level group advantage: every turn of a trajectory gets its outcome's score
  gigpo  GRPO's plus GiGPO's step-level score of the turn's return among the turns of its task
         that answered the same observation (algorithm.gigpo_step_weight 1, gamma 1)

Echo shows all samples of a task the same symbols, so every turn after the first shares its
state with the other samples that got that far (and, with two symbols, with the task's other
turns showing the same symbol): the step groups GiGPO needs exist from the first step.

`c.model.name` must be set by the caller to a Hugging Face checkpoint directory whose tokenizer
makes the symbols '0' and '1' single tokens, e.g. the tiny random model of tests/tiny.py (as
notebooks/gigpo_ablation.ipynb does):

  python launch/train.py --config=configs/gigpo_echo.py:gigpo --workdir=runs/echo_gigpo \
      --config.model.name=/path/to/tiny_checkpoint --config.mesh.fsdp=1
"""

from agentgym_jax.config import base_config, tiny_echo

TURNS = 3
VARIANTS = ("grpo", "gigpo")


def get_config(variant: str = "gigpo"):
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
  c = base_config()
  c.steps = 50
  c.model.name = ""  # Set by the caller: a checkpoint directory (see the module docstring).
  tiny_echo(c)
  c.env.options.turns = TURNS
  c.rollout.max_context = 128  # Instruction plus three turns of ~10 tokens each.
  c.horizon.kind = "fixed"
  c.horizon.turns = TURNS
  c.algorithm.advantage = variant
  return c
