"""DAPO (Yu et al. 2025) on TextCraft with ScalingInter-RL; everything else as grpo_textcraft.py.

DAPO's dynamic sampling (groups whose episodes all succeed or all fail are dropped and more
tasks are played, up to 3 rounds of 32 a step), clip-higher (eps_high 0.28 against eps_low
0.2), the token-level loss (token-mean), no KL term, and its soft overlong penalty on each
reply: one that comes within 128 tokens of its 512-token budget loses up to 1 (DAPO: 4,096 of
20,480; the local variant keeps the quarter, 16 of 64).
"""

from agentgym_jax.config import experiment

get_config = experiment(
    "textcraft", {
        "rollout.dynamic_sampling": True,
        "rollout.max_sampling_rounds": 3,
        "algorithm.clip_eps_high": 0.28,
        "algorithm.aggregation": "token-mean",
        "algorithm.kl_coef": 0.0,
        "algorithm.overlong_buffer.length": 128,
    })
