r"""DPO on TextCraft rollouts: per task, a successful trajectory is preferred to a failed one.

The pairs come from the trajectories an RL run logged (workdir/trajectories); the policy starts
from, and is regularised towards, the model that `model.name` names (beta 0.1). Collect
rollouts first, e.g. with the GRPO recipe, then train on them:

  python launch/train.py --config=configs/grpo_textcraft.py:local --workdir=runs/local
  python launch/train.py --config=configs/dpo_textcraft.py:local --workdir=runs/dpo_local

The default trains Qwen2.5-7B-Instruct on the paper-sized run's rollouts and reports greedy
success on the test split every 20 steps:

  python launch/train.py --config=configs/grpo_textcraft.py --workdir=runs/grpo_textcraft
  python launch/train.py --config=configs/dpo_textcraft.py --workdir=runs/dpo_textcraft

`data.path` may also be a JSONL of trajectory records with task_id, messages, reward and
success (e.g. demonstrations and failed rollouts of the same tasks).
"""

from agentgym_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.base_config()
  c.mode = "dpo"
  c.env.name = "textcraft"
  c.data.path = "runs/grpo_textcraft"
  c.data.batch_size = 16  # Pairs per step.
  c.data.max_length = 16384  # rollout.max_context: every logged trajectory fits.
  c.data.min_reward = 1.0  # The chosen trajectory succeeded.
  c.dpo.beta = 0.1
  c.steps = 100
  c.optim.learning_rate = 5e-7
  c.optim.schedule = "cosine"
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  c.checkpoint.every = 20
  c.eval.every = 20
  return config_lib.apply_variants(c, variant, {"local": local})


def local(c):
  """config.local (the embedded model; evaluation sized for a CPU), on the rollouts of
  configs/grpo_textcraft.py:local."""
  config_lib.local(c)
  c.data.path = "runs/local"
  c.data.batch_size = 2
  c.data.max_length = 2048  # rollout.max_context of grpo_textcraft.py:local.
  c.steps = 20
  c.optim.learning_rate = 5e-6
  c.optim.warmup_steps = 2
  c.checkpoint.every = 5
  c.eval.every = 0  # As in sft_textcraft.py:local.
  c.eval.max_tasks = 20
