r"""GRPO on TextCraft with the ScalingInter-RL horizon schedule (the paper's main recipe).

The default is the paper's setting: Qwen2.5-7B-Instruct, 32 tasks x 8 samples per step, lr 1e-6
(constant AdamW, weight decay 0.01), KL loss 1e-3 (low_var_kl), entropy bonus 1e-3, clip 0.2,
turn caps [10, 20, 30] raised every 100 steps, 512 new tokens per turn:

  python launch/train.py --config=configs/grpo_textcraft.py --workdir=runs/grpo_textcraft

Variants (comma-separated): `local` is the whole recipe on a CPU workstation with the embedded
SmolLM2-135M-Instruct: on goals of crafting depth 1-2 (`shallow`), an SFT warm start on the
oracle's demonstrations of train goals, then GRPO with the staged horizon on depth-1 goals and,
in its last stage, depth 1-2, each stage's policy evaluated greedily on the 72 held-out test
goals and tabled at the end (docs/results.md, "The first command on a CPU"). `short` and `long`
are the fixed-horizon baselines (10 and 30 turns); `shallow` keeps only goals of crafting depth
1-2 in every split; `agentgym` plays the original AgentGym TextCraft's 544 goals instead of our 551
(env.options.goals; environments/textcraft/env.py, "Tasks"):

  python launch/train.py --config=configs/grpo_textcraft.py:local --workdir=runs/local
  python launch/train.py --config=configs/grpo_textcraft.py:long --workdir=runs/fixed30
  python launch/train.py --config=configs/grpo_textcraft.py:agentgym --workdir=runs/agentgym

Any registry model (agentgym_jax.models.MODELS: SmolLM2, Qwen2.5, Qwen3, Llama 3.1/3.2) or
checkpoint directory runs it, its chat layout read off its own template; actions may be tool
calls, and Qwen3 may run with thinking off:

  python launch/train.py --config=configs/grpo_textcraft.py \
      --config.model.name=llama-3.2-3b-instruct --config.env.action_format=tool_call
  python launch/train.py --config=configs/grpo_textcraft.py --config.model.name=qwen3-4b \
      --config.model.thinking=off
"""

from agentgym_jax import config


def shallow(c):
  c.env.options.max_depth = 2


def agentgym_goals(c):
  c.env.options.goals = "agentgym"


def local(c):
  config.local(c)
  shallow(c)
  # Warm start: 30 SFT steps of 4 demonstrations (the oracle's, of the depth 1-2 train goals).
  c.warm_start.steps = 30
  c.warm_start.learning_rate = 1e-4
  # GRPO where the warm-started policy has signal: depth-1 goals (it solves 12-100% of their
  # samples; depth-2 train goals it never solved), then depth 1-2 for the last horizon stage;
  # 2 tasks x 4 samples a step, turn caps 3, 5 and 8 for 4, 4 and 2 steps; no reference pass.
  c.steps = 10
  c.horizon.every = 4
  c.rollout.curriculum = (("depth1",), ("depth1",), ("depth1", "depth2"))
  c.rollout.tasks_per_step = 2
  c.rollout.cache_dtype = "bfloat16"
  c.algorithm.kl_coef = 0.0
  c.optim.learning_rate = 2e-5
  c.checkpoint.every = 2
  # Each stage's policy on the 72 held-out goals of depth 1-2, greedy, all at once.
  c.eval.stages = True
  c.eval.rows = 72


get_config = config.experiment(
    "textcraft", variants={"local": local, "shallow": shallow, "agentgym": agentgym_goals})
