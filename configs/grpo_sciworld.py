r"""GRPO on SciWorld with ScalingInter-RL: 16 tasks x 8 samples, turn caps [10, 20, 30] every
100 steps, 200 new tokens per turn (the paper's SciWorld script). Each env slot runs a JVM, so
the process backend is used: a hung simulator is killed, not abandoned.

  python launch/train.py --config=configs/grpo_sciworld.py --workdir=runs/grpo_sciworld

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 10 / 30 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "sciworld"
  c.env.backend = "process"
  c.rollout.tasks_per_step = 16
  c.rollout.max_new_tokens = 200
  return apply_variants(c, variant, standard_variants())
