r"""Dr. GRPO (Liu et al. 2025) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

GRPO without its two length and difficulty biases: advantages are rewards minus the group mean
(no division by the group's std), and the loss sums each trajectory's tokens and divides by a
constant (seq-mean-token-sum-norm; algorithm.loss_scale_tokens = 0 takes 512 new tokens x 30
turns, the most a trajectory can have trained).

  python launch/train.py --config=configs/drgrpo_textcraft.py --workdir=runs/drgrpo_textcraft
  python launch/train.py --config=configs/drgrpo_textcraft.py:local --workdir=runs/drgrpo_local

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 10 / 30 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  c.algorithm.grpo_normalize_by_std = False
  c.algorithm.aggregation = "seq-mean-token-sum-norm"
  return apply_variants(c, variant, standard_variants())
