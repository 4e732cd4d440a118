r"""GRPO on a mixture of AgentGym environments (env.mixture): every step's tasks drawn from
TextCraft, BabyAI and SearchQA in equal shares, and SciWorld too where `java` is on the PATH
(it runs a JVM, Java 17). Each task picks its environment by weight and then that
environment's next train task; its group plays it with the environment's own instruction, and
the step logs env/<name>/success, reward, turns and truncated_fraction for each environment it
played. The horizon schedule is the paper's TextCraft one (turn caps [10, 20, 30] every 100
steps); BabyAI keeps its own largest cap of 20 turns (the paper's BabyAI script) and SearchQA
a cap of 10 (its generated questions need 2-3 searches and an answer). Evaluations report
every environment's table and the whole's.

  python launch/train.py --config=configs/mixed_agentgym.py --workdir=runs/mixed
  python launch/train.py --config=configs/mixed_agentgym.py:local --workdir=runs/mixed_local

`local` is the embedded SmolLM2-135M-Instruct on a CPU (config.local). Another mixture, e.g.
TextCraft twice as often as BabyAI and nothing else:
`--config.env.mixture="({'name': 'textcraft', 'weight': 2.0}, {'name': 'babyai', 'weight': 1.0})"`.
The adapters run in threads (env.backend); `--config.env.backend=process` kills a hung
simulator instead of abandoning it, at a process for each slot and environment it played.
"""

import shutil

from agentgym_jax.config import experiment


def environments() -> tuple[dict, ...]:
  """The mixture's components: SciWorld only where Java is installed."""
  components = (
      {"name": "textcraft", "weight": 1.0},
      {"name": "babyai", "weight": 1.0, "horizon": 20},
      {"name": "searchqa", "weight": 1.0, "horizon": 10},
  )
  if shutil.which("java"):
    components += ({"name": "sciworld", "weight": 1.0},)
  return components


def get_config(variant: str = ""):
  return experiment("mixture", {"env.mixture": environments()})(variant)
