r"""GRPO on TextCraft with ScalingInter-RL, training LoRA adapters (Hu et al. 2021) only;
everything else as grpo_textcraft.py.

Rank-64 adapters (alpha 128) on every attention and MLP projection of the frozen Qwen2.5-7B-
Instruct: only the adapters and AdamW's moments of them are trained, sharded and checkpointed
(the base comes from model.name at resume); the sampler runs the merged weights W + delta W; the
KL's reference is the base itself, so no reference copy of the model is kept. The learning rate
is 10x the full fine-tuning one (1e-5): adapters start at zero and move through a rank-64
bottleneck. The run exports a PEFT adapter directory (`peft`'s PeftModel.from_pretrained loads
it over the base); `--config.checkpoint.export_format=merged` writes the merged model instead.

  python launch/train.py --config=configs/lora_textcraft.py --workdir=runs/lora_textcraft
  python launch/train.py --config=configs/lora_textcraft.py:local --workdir=runs/lora_local

Variants: `local` (embedded SmolLM2 on a CPU), `short` / `long` (fixed 10 / 30 turns).
"""

from agentgym_jax.config import apply_variants, base_config, standard_variants


def get_config(variant: str = ""):
  c = base_config()
  c.env.name = "textcraft"
  c.model.lora.rank = 64
  c.model.lora.alpha = 128.0
  c.optim.learning_rate = 1e-5
  c.checkpoint.export_format = "peft"
  return apply_variants(c, variant, standard_variants())
