r"""GRPO with truncated importance sampling on TextCraft; everything else as grpo_textcraft.py.

The rollout correction for a sampler whose probabilities differ from the learner's (another
precision or kernel): each token's policy-gradient loss is weighted by
min(pi_learner / pi_sampler, 2). The per-turn mismatch metrics (mismatch/turn_K/log_ratio,
mismatch/turn_K/kl) show how far apart the two are, turn by turn.

  python launch/train.py --config=configs/tis_textcraft.py --workdir=runs/tis_textcraft
  python launch/train.py --config=configs/tis_textcraft.py:local --workdir=runs/tis_local

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 10 / 30 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  c.algorithm.rollout_correction = "token_tis"
  c.algorithm.rollout_correction_cap = 2.0
  return apply_variants(c, variant, standard_variants())
