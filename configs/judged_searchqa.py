"""GRPO on SearchQA (the paper's recipe, base_config) with a model judging the answers.

Exact match fails an answer worded unlike every gold answer ("the Nether" for "Nether"). With
env.options.judge_answers each answer also asks the judge whether it means one of the gold
answers, and the judge's verdict is the reward (reward.judge mode "reference", judge.py). The
judge here is the shipped SmolLM2-135M-Instruct, which runs anywhere but judges poorly; point it
at a stronger model, one the sampler runs or an OpenAI-compatible server:

  python launch/train.py --config=configs/judged_searchqa.py \\
      --config.reward.judge.model=qwen2.5-7b-instruct
  python launch/train.py --config=configs/judged_searchqa.py --config.reward.judge.model= \\
      --config.reward.judge.base_url=http://judge-host:8000/v1 \\
      --config.reward.judge.served_model=Qwen/Qwen2.5-72B-Instruct

docs/rewards.md has the rubric and RULER-style group modes for environments without answers.
"""

from agentgym_jax.config import experiment

get_config = experiment(
    "searchqa", {
        "env.options.judge_answers": True,
        "reward.judge.mode": "reference",
        "reward.judge.model": "smollm2-135m-instruct",
    }, short=5, long=10)
