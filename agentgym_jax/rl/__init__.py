"""Pure-function RL math: advantage estimators, losses, per-token log-probs, and registries."""

from agentgym_jax.rl.advantages import ADVANTAGE_ESTIMATORS
from agentgym_jax.rl.advantages import Advantages
from agentgym_jax.rl.advantages import gae_advantages
from agentgym_jax.rl.advantages import get_advantage_estimator
from agentgym_jax.rl.advantages import group_mean_and_std
from agentgym_jax.rl.advantages import grpo_advantages
from agentgym_jax.rl.advantages import place_on_last_trained_token
from agentgym_jax.rl.advantages import reinforce_plus_plus_advantages
from agentgym_jax.rl.advantages import rloo_advantages
from agentgym_jax.rl.losses import AGGREGATIONS
from agentgym_jax.rl.losses import aggregate
from agentgym_jax.rl.losses import chunked_token_logprobs_and_entropy
from agentgym_jax.rl.losses import dpo_loss
from agentgym_jax.rl.losses import entropy_bonus
from agentgym_jax.rl.losses import KL_ESTIMATORS
from agentgym_jax.rl.losses import kl_divergence
from agentgym_jax.rl.losses import kl_loss
from agentgym_jax.rl.losses import kl_penalty_rewards
from agentgym_jax.rl.losses import policy_gradient_loss
from agentgym_jax.rl.losses import sequence_logprobs
from agentgym_jax.rl.losses import sft_loss
from agentgym_jax.rl.losses import token_logprobs_and_entropy
from agentgym_jax.rl.losses import value_loss
from agentgym_jax.rl.masked import masked_mean
from agentgym_jax.rl.masked import masked_sum
from agentgym_jax.rl.masked import masked_whiten
