"""GRPO on TextCraft with ScalingInter-RL, training LoRA adapters (Hu et al. 2021) only;
everything else as grpo_textcraft.py.

Rank-64 adapters (alpha 128) on every attention and MLP projection of the frozen Qwen2.5-7B-
Instruct: only the adapters and AdamW's moments of them are trained, sharded and checkpointed
(the base comes from model.name at resume); the sampler runs the merged weights W + delta W; the
KL's reference is the base itself, so no reference copy of the model is kept. The learning rate
is 10x the full fine-tuning one (1e-5): adapters start at zero and move through a rank-64
bottleneck. The run exports a PEFT adapter directory (`peft`'s PeftModel.from_pretrained loads
it over the base); `--config.checkpoint.export_format=merged` writes the merged model instead.
"""

from agentgym_jax.config import experiment

get_config = experiment(
    "textcraft", {
        "model.lora.rank": 64,
        "model.lora.alpha": 128.0,
        "optim.learning_rate": 1e-5,
        "checkpoint.export_format": "peft",
    })
