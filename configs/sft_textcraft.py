r"""SFT on verified TextCraft demonstrations (the oracle's plans, replayed through the env).

First write the demonstrations (352 train tasks of crafting depth <= 2, 520-1520 SmolLM2 tokens
each, ~830 on average):

  python launch/make_demos.py --env=textcraft --split=train --max_depth=2 \
      --out=data/textcraft_train_demos.jsonl

The default trains Qwen2.5-7B-Instruct, 3 epochs of 32 conversations per step, lr 1e-5 (cosine,
warm-up 3 steps), and reports greedy success on the test split after every epoch:

  python launch/train.py --config=configs/sft_textcraft.py --workdir=runs/sft_textcraft

`:local` trains the embedded SmolLM2-135M-Instruct on a CPU workstation: one epoch of 4
conversations per step (hours on 2 cores; model.remat=auto picks what fits in memory),
without evaluation (add --config.eval.every=88 to play 20 test tasks at the end):

  python launch/train.py --config=configs/sft_textcraft.py:local --workdir=runs/sft_local

The trained policy is written as a Hugging Face directory (workdir/export).
"""

from agentgym_jax import config as config_lib


def get_config(variant: str = ""):
  c = config_lib.base_config()
  c.mode = "sft"
  c.env.name = "textcraft"
  c.data.path = "data/textcraft_train_demos.jsonl"
  c.data.batch_size = 32
  c.data.max_length = 2048  # The longest demonstration has ~1.5k tokens.
  c.steps = 33  # 3 epochs of 352 conversations.
  c.optim.learning_rate = 1e-5
  c.optim.schedule = "cosine"
  c.optim.warmup_steps = 3
  c.optim.weight_decay = 0.0
  c.checkpoint.every = 11
  c.eval.every = 11
  return config_lib.apply_variants(c, variant, {"local": local})


def local(c):
  """config.local (the embedded model; evaluation sized for a CPU), one epoch of SFT."""
  config_lib.local(c)
  c.data.batch_size = 4
  c.steps = 88  # 352 conversations / 4.
  c.optim.learning_rate = 3e-5
  c.optim.warmup_steps = 5
  c.checkpoint.every = 20
  c.eval.every = 0
  c.eval.max_tasks = 20
