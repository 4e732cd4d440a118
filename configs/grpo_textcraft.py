r"""GRPO on TextCraft with the ScalingInter-RL horizon schedule (the paper's main recipe).

The default is the paper's setting: Qwen2.5-7B-Instruct, 32 tasks x 8 samples per step, lr 1e-6
(constant AdamW, weight decay 0.01), KL loss 1e-3 (low_var_kl), entropy bonus 1e-3, clip 0.2,
turn caps [10, 20, 30] raised every 100 steps, 512 new tokens per turn:

  python launch/train.py --config=configs/grpo_textcraft.py --workdir=runs/grpo_textcraft

Variants (comma-separated): `local` runs the embedded SmolLM2-135M-Instruct sized for a CPU
workstation; `short` and `long` are the fixed-horizon baselines (10 and 30 turns); `shallow`
keeps only goals of crafting depth 1-2 in every split (a curriculum for small models, and the
held-out goals of the CPU learning result in the README):

  python launch/train.py --config=configs/grpo_textcraft.py:local --workdir=runs/local
  python launch/train.py --config=configs/grpo_textcraft.py:long --workdir=runs/fixed30

Any registry model (agentgym_jax.models.MODELS: SmolLM2, Qwen2.5, Qwen3, Llama 3.1/3.2) or
checkpoint directory runs it, its chat layout read off its own template; actions may be tool
calls, and Qwen3 may run with thinking off:

  python launch/train.py --config=configs/grpo_textcraft.py \
      --config.model.name=llama-3.2-3b-instruct --config.env.action_format=tool_call
  python launch/train.py --config=configs/grpo_textcraft.py --config.model.name=qwen3-4b \
      --config.model.thinking=off
"""

from agentgym_jax.config import apply_variants, base_config, fixed_horizon, local


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  return apply_variants(c, variant, {"local": local, "short": fixed_horizon(10),
                                     "long": fixed_horizon(30), "shallow": shallow})


def shallow(c):
  c.env.options.max_depth = 2
