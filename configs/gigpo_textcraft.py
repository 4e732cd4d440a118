r"""GiGPO (Feng et al. 2025) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

GRPO's episode-level advantage plus GiGPO's step level: the turns of a task's samples that
answer the same observation (the same inventory, the same error) form a step group, scored on
their discounted returns with the paper's gamma 0.95 and step weight 1. Logged:
gigpo/anchored_turns and gigpo/step_group_size (how many later turns share a state).

  python launch/train.py --config=configs/gigpo_textcraft.py --workdir=runs/gigpo_textcraft
  python launch/train.py --config=configs/gigpo_textcraft.py:local --workdir=runs/gigpo_local

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 10 / 30 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  c.algorithm.advantage = "gigpo"
  c.algorithm.gigpo_step_weight = 1.0
  c.algorithm.gamma = 0.95
  return apply_variants(c, variant, standard_variants())
