"""GRPO on TextCraft with observation masking: every reply kept, the observations of all but the
last 4 turns replaced by a placeholder; everything else as grpo_textcraft.py.

A TextCraft episode's context grows by a reply and an observation every turn; at the paper's
30-turn cap that is most of its 10,240 tokens. With rollout.context=mask_observations the row's
context is rewritten every 4 turns from turn 8 on (and whenever the next turn would not fit), so
it holds the goal and its recipes, every action, and the last 4 to 8 observations whole; each
context trains as its own sequence. `window` keeps the last turns only (`--config.rollout.context
=window`). At a 30-turn cap (`:local,long`) masking lowers TextCraft's peak context only 13%
and costs about 6 times the step, since its contexts are mostly the task and the replies
(docs/training.md, "Long episodes"; docs/long_context.sh measures it against `full`):

  python launch/train.py --config=configs/context_textcraft.py:local,long --workdir=runs/masked
"""

from agentgym_jax.config import experiment

get_config = experiment("textcraft", {
    "rollout.context": "mask_observations",
    "rollout.context_turns": 4,
})
