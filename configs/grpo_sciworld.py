"""GRPO on SciWorld with ScalingInter-RL: 16 tasks x 8 samples, turn caps [10, 20, 30] every
100 steps, 200 new tokens per turn (the paper's SciWorld script). Each env slot runs a JVM, so
the process backend is used: a hung simulator is killed, not abandoned."""

from agentgym_jax.config import experiment

get_config = experiment("sciworld", {
    "env.backend": "process",
    "rollout.tasks_per_step": 16,
    "rollout.max_new_tokens": 200,
})
