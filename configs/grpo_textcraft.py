r"""GRPO on TextCraft with the ScalingInter-RL horizon schedule (the paper's main recipe).

The default is the paper's setting: Qwen2.5-7B-Instruct, 32 tasks x 8 samples per step, lr 1e-6
(constant AdamW, weight decay 0.01), KL loss 1e-3 (low_var_kl), entropy bonus 1e-3, clip 0.2,
turn caps [10, 20, 30] raised every 100 steps, 512 new tokens per turn:

  python launch/train.py --config=configs/grpo_textcraft.py --workdir=runs/grpo_textcraft

`:local` runs the embedded SmolLM2-135M-Instruct sized for a CPU workstation:

  python launch/train.py --config=configs/grpo_textcraft.py:local --workdir=runs/local
"""

from agentgym_jax.config import base_config


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  if variant == "local":
    local(c)
  elif variant:
    raise ValueError(f"unknown variant {variant!r}; expected '' or 'local'")
  return c


def local(c):
  """The embedded model on a CPU: small batches, short replies, short horizons."""
  c.steps = 20
  c.model.name = "smollm2-135m-instruct"
  c.model.remat = "none"
  c.rollout.tasks_per_step = 4
  c.rollout.samples_per_task = 4
  c.rollout.max_new_tokens = 64
  c.rollout.max_context = 2048
  c.horizon.caps = (4, 6, 8)
  c.horizon.every = 8
  c.algorithm.num_minibatches = 2
  c.optim.learning_rate = 1e-5
  c.checkpoint.every = 5
