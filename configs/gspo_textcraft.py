r"""GSPO (Zheng et al. 2025) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

GRPO's group advantages with GSPO's policy loss: one length-normalised importance ratio per
trajectory, clipped to [1 - 3e-4, 1 + 4e-4] (the paper's range), each trajectory weighing the
same (seq-mean-token-mean).

  python launch/train.py --config=configs/gspo_textcraft.py --workdir=runs/gspo_textcraft
  python launch/train.py --config=configs/gspo_textcraft.py:local --workdir=runs/gspo_local

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 10 / 30 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  c.algorithm.policy_loss = "gspo"
  c.algorithm.aggregation = "seq-mean-token-mean"
  return apply_variants(c, variant, standard_variants())
