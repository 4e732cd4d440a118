r"""DAPO (Yu et al. 2025) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

DAPO's dynamic sampling (groups whose episodes all succeed or all fail are dropped and more
tasks are played, up to 3 rounds of 32 a step), clip-higher (eps_high 0.28 against eps_low
0.2), the token-level loss (token-mean) and no KL term. Its overlong reward shaping is not part
of it: a reply cut by the token limit ends its turn as in every recipe here.

  python launch/train.py --config=configs/dapo_textcraft.py --workdir=runs/dapo_textcraft
  python launch/train.py --config=configs/dapo_textcraft.py:local --workdir=runs/dapo_local

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 10 / 30 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  c.rollout.dynamic_sampling = True
  c.rollout.max_sampling_rounds = 3
  c.algorithm.clip_eps_high = 0.28
  c.algorithm.aggregation = "token-mean"
  c.algorithm.kl_coef = 0.0
  return apply_variants(c, variant, standard_variants())
