"""The experiment configs, shipped in the package as agentgym_jax.configs: each file's
get_config(variant) builds one run (docs in its docstring). Every one runs as

  python launch/train.py --config=configs/NAME.py[:VARIANTS] --workdir=runs/NAME

where VARIANTS is a comma-separated list. The RL configs built by `config.experiment` all offer
`local` (the embedded SmolLM2-135M-Instruct on a CPU), `short` and `long` (the paper's fixed
horizon baselines of 10 and 30 turns, BabyAI's 6 and 20), e.g. `configs/ppo_textcraft.py:local`.
"""
