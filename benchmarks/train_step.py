"""The RL training step on SmolLM2-135M-Instruct: ours (JAX) against PyTorch + transformers.

  python benchmarks/train_step.py                       # batch 8 x 512 tokens, f32, remat=full
  python benchmarks/train_step.py --quick               # batch 2 x 128, a few minutes
  python benchmarks/train_step.py --remat=none,full,dots --dtypes=bfloat16
  python benchmarks/train_step.py --attention=flash,dense --remat=none,full --length=2048

The step is what the trainer runs on one rollout batch with GRPO and a KL loss to the
reference (one epoch, one minibatch):
  experience  log-probs of the batch under the policy and under the frozen reference (two
              forward passes, no gradient), GRPO advantages;
  update      forward + backward of the clipped surrogate + KL loss, global-norm clipping and
              AdamW on every parameter.
Ours is the real code path: `learner.compute_experience` and `learner.jit_update_step` on a
synthetic `batch.Batch` (random tokens, the first quarter of each row a prompt outside the
loss). The PyTorch step is the same computation written for transformers'
AutoModelForCausalLM, loaded from our weights exported with `weights.save_hf` (f32): a
no-grad forward of the policy and of a reference copy, then forward + backward + clipping +
torch.optim.AdamW; log-probs come from the lm_head applied per chunk of `--logprob_chunk`
positions (ours: per chunk, in blocks of hardware.logits_block_tokens within it, with its own
VJP: rl.chunked_token_logprobs_and_entropy).

Dtypes (--dtypes for ours, --torch_dtypes for PyTorch; one row each):
  bfloat16  ours: matmul inputs bf16, f32 parameters and accumulation (the trainer's default);
            torch: torch.autocast("cpu", bfloat16) around the forward passes, f32 parameters.
  float32   all f32.
PyTorch runs f32 by default: on a CPU without AVX512-BF16/AMX its bf16 matmuls fall back to
slow reference kernels (0.45 vs 25 GFLOP/s for 1024^3 on a 2-core AVX2 VM), so a bf16 step
would time the fallback, not the framework; the header prints torch's matmul rate in both
dtypes so the choice is visible. "x torch" compares each of our rows with the fastest torch
row.

FLOPs. N counts the parameters of every matmul (all layer weights and the vocabulary
projection, which a tied embedding still runs; not the embedding lookup or the norms). A
forward pass over B rows of T tokens costs 2 N B T for the weights plus 4 L H d_h T^2 B for
attention (QK^T and AV over the full T x T score matrix, which dense attention and torch's
compute before masking, and of which flash attention computes the tiles on and below the
diagonal; PaLM's convention); forward + backward is 3 forwards. A step is therefore
5 forwards (policy, reference, and 3 for the update); recomputation under remat is not counted,
so remat rows show what useful work per second they keep. Achieved FLOP/s is step FLOPs / step
time, shown as a fraction of the peak of one large matmul measured at the start of the run
(`jnp.dot` of two S x S matrices, bf16 inputs with f32 accumulation, and f32).

Each variant runs --warmup untimed steps (compilation, allocator warm-up); then --steps rounds
each time one step of every variant in turn, so that other work on the machine weighs on all
of them alike, and the table gives each variant's median. Other work still skews every figure:
the header and the footer print the load average.
"""

from __future__ import annotations

import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

from absl import app
from absl import flags

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import agentgym_jax
from agentgym_jax import batch as batch_lib
from agentgym_jax import hardware, learner
from agentgym_jax.models import attention as attention_lib, weights

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Registry name or HF directory.")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows per step (--quick: 2).")
_LENGTH = flags.DEFINE_integer("length", 512, "Tokens per row (--quick: 128).")
_DTYPES = flags.DEFINE_list(
    "dtypes", ["auto"],
    "Our matmul dtypes (auto: bf16 on a CPU with AMX or AVX512-BF16, f32 otherwise; the header "
    "prints both matmul peaks).")
_TORCH_DTYPES = flags.DEFINE_list(
    "torch_dtypes", ["auto"],
    "PyTorch's dtypes (auto as ours: bfloat16 autocast is ~50x slower than f32 on CPUs without "
    "AVX512-BF16; the header prints both of torch's matmul rates).")
_REMAT = flags.DEFINE_list(
    "remat", ["full"],
    "Our remat policies to measure: none,full,dots (with dense attention, none keeps every "
    "layer's attention probabilities: over 24 GB at the default batch; dots over 14 GB).")
_ATTENTION = flags.DEFINE_list(
    "attention", ["auto"],
    "Our attention implementations to measure: auto (flash on CPU), flash, dense (the "
    "reference, which materialises the T x T scores).")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per variant (--quick: 2).")
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed steps per variant.")
_LOGPROB_CHUNK = flags.DEFINE_integer("logprob_chunk", 512, "Positions per log-prob chunk.")
_PEAK_SIZE = flags.DEFINE_integer("peak_size", 2048, "Side of the matmul measuring the peak.")
_TORCH = flags.DEFINE_bool("torch", True, "Also measure PyTorch + transformers.")
_QUICK = flags.DEFINE_bool("quick", False, "Batch 2 x 128 tokens, 2 timed steps.")

KL_COEF = 1e-3


def matmul_peak(size: int, dtype: Any, repeats: int = 5) -> float:
  """FLOP/s of the best of `repeats` S x S x S jnp.dot calls (f32 accumulation)."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32).astype(dtype)
  dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
  dot(a, b).block_until_ready()
  best = min(_timed(lambda: dot(a, b).block_until_ready()) for _ in range(repeats))
  return 2 * size**3 / best


def torch_matmul_rate(size: int, dtype: str, repeats: int = 3) -> float:
  """FLOP/s of the best of `repeats` S x S x S torch matmuls in `dtype`."""
  import torch

  a, b = (torch.randn(size, size).to(getattr(torch, dtype)) for _ in range(2))
  a @ b
  return 2 * size**3 / min(_timed(lambda: a @ b) for _ in range(repeats))


def _timed(fn: Callable[[], Any]) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def step_flops(config, batch: int, length: int) -> tuple[float, int]:
  """(FLOPs of one step, matmul parameter count N); see the module docstring."""
  e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
  q = config.num_heads * config.head_dim
  kv = config.num_kv_heads * config.head_dim
  per_layer = e * q + 2 * e * kv + q * e + 3 * e * f
  n = config.num_layers * per_layer + e * v
  forward = 2 * n * batch * length + 4 * config.num_layers * q * length**2 * batch
  return 5.0 * forward, n


def synthetic_batch(vocab: int, batch: int, length: int) -> batch_lib.Batch:
  """Random tokens; each row's first quarter is a prompt, the rest generated; groups of 2."""
  rng = np.random.default_rng(0)
  loss_mask = np.zeros((batch, length), np.float32)
  loss_mask[:, length // 4:] = 1.0
  return batch_lib.Batch(tokens=rng.integers(0, vocab, (batch, length)).astype(np.int32),
                         loss_mask=loss_mask, sampler_logprobs=np.where(loss_mask > 0, -10.0,
                                                                        0.0).astype(np.float32),
                         rewards=rng.integers(0, 2, batch).astype(np.float32),
                         group_ids=(np.arange(batch) // 2).astype(np.int32))


def ours_step(model, dtype: str, remat: str, attention: str,
              batch: batch_lib.Batch) -> Callable[[], None]:
  """A closure running one step (experience + update) of our learner, blocking on its end."""
  model.dtype = jnp.dtype(dtype)
  model.remat = remat
  model.attention = attention
  graphdef, params = nnx.split(model)
  # Copies, since the update donates its parameters; committed to their devices, as the
  # update's outputs are, so that the second step does not compile again.
  shardings_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  params = jax.device_put(jax.tree.map(jnp.copy, params), shardings_of(params))
  ref_params = jax.tree.map(jnp.copy, params)
  loss = learner.LossConfig(advantage_estimator="grpo",
                            advantage_options=(("normalize_by_std", True),), clip_eps_high=0.28,
                            kl_coef=KL_COEF, logprob_chunk=_LOGPROB_CHUNK.value)
  optimizer = learner.make_optimizer(1e-6)
  opt_state = jax.jit(optimizer.init)((params, None))
  opt_state = jax.device_put(opt_state, shardings_of(opt_state))
  state = learner.UpdateState((params, None), opt_state)
  update = learner.jit_update_step(shardings_of(state))
  batch = jax.device_put(batch, jax.devices()[0])
  networks = learner.Networks(graphdef)
  current = [state]

  def step():
    experience, _ = learner.compute_experience(networks, current[0].trainable, ref_params, batch,
                                               loss=loss, num_groups=2 * batch.tokens.shape[0])
    current[0], metrics = update(networks, current[0], batch, experience, optimizer=optimizer,
                                 loss=loss)
    jax.block_until_ready((current[0], metrics))

  return step


def torch_step(directory: pathlib.Path, dtype: str, batch: batch_lib.Batch) -> Callable[[], None]:
  """The same step in PyTorch + transformers (see the module docstring)."""
  import torch
  import transformers

  policy = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  print(f"torch attention: transformers' {policy.config._attn_implementation}")  # pylint: disable=protected-access
  policy.train()
  reference.eval()
  for p in reference.parameters():
    p.requires_grad_(False)
  optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.01)
  tokens = torch.from_numpy(np.asarray(batch.tokens)).long()
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  mask = torch.from_numpy(np.asarray(batch.loss_mask)[:, 1:])
  rewards = torch.from_numpy(np.asarray(batch.rewards))
  chunk = _LOGPROB_CHUNK.value
  autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bfloat16" else (
      lambda: torch.autocast("cpu", enabled=False))

  def logprobs(model) -> torch.Tensor:
    with autocast():
      hidden = model.model(input_ids=inputs).last_hidden_state
      pieces = []
      for start in range(0, hidden.shape[1], chunk):
        logits = model.lm_head(hidden[:, start:start + chunk]).float()
        pieces.append(
            torch.gather(torch.log_softmax(logits, -1), -1, targets[:, start:start + chunk,
                                                                    None])[..., 0])
    return torch.cat(pieces, dim=1)

  def step():
    with torch.no_grad():
      old = logprobs(policy)
      ref = logprobs(reference)
      # GRPO: reward minus the group mean, over the group std (groups of 2 rows).
      grouped = rewards.view(-1, 2)
      advantage = ((grouped - grouped.mean(1, keepdim=True)) /
                   (grouped.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    new = logprobs(policy)
    ratio = torch.exp(new - old)
    surrogate = -torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - 0.2, 1 + 0.28) * advantage)
    log_ratio = torch.clamp(ref - new, -20, 20)
    kl = torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10, 10)  # low_var_kl
    loss = ((surrogate + KL_COEF * kl) * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()

  return step


def measure(steps: list[Callable[[], None]], warmup: int, rounds: int) -> list[tuple[float, float]]:
  """(first call seconds, median timed seconds) of each step function: `warmup` calls each,
  then `rounds` rounds timing one call of each in turn."""
  firsts = []
  for step in steps:
    firsts.append(_timed(step))
    for _ in range(warmup - 1):
      step()
  timed: list[list[float]] = [[] for _ in steps]
  for _ in range(rounds):
    for times, step in zip(timed, steps):
      times.append(_timed(step))
  return [(first, statistics.median(times)) for first, times in zip(firsts, timed)]


def main(argv):
  del argv
  batch_size, length = (2, 128) if _QUICK.value else (_BATCH.value, _LENGTH.value)
  timed_steps = 2 if _QUICK.value else _STEPS.value
  print("command: " + " ".join([os.path.basename(sys.executable)] + sys.argv))
  print(hardware.describe())
  print(f"host: {platform.node()}, {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, jax {jax.__version__} "
        f"({jax.devices()[0].platform})")
  peaks = {name: matmul_peak(_PEAK_SIZE.value, jnp.dtype(name)) for name in ("bfloat16", "float32")}
  print(f"matmul peak ({_PEAK_SIZE.value}^3 jnp.dot, f32 accumulation): "
        f"bf16 {peaks['bfloat16'] / 1e9:.1f} GFLOP/s, f32 {peaks['float32'] / 1e9:.1f} GFLOP/s")
  if _TORCH.value:
    rates = {name: torch_matmul_rate(1024, name) for name in ("bfloat16", "float32")}
    print(f"torch matmul (1024^3): bf16 {rates['bfloat16'] / 1e9:.2f} GFLOP/s, "
          f"f32 {rates['float32'] / 1e9:.2f} GFLOP/s")

  model, _ = agentgym_jax.load_model(_MODEL.value, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  config = model.config
  batch = synthetic_batch(config.vocab_size, batch_size, length)
  flops, n = step_flops(config, batch_size, length)
  tokens = batch_size * length
  print(f"model {_MODEL.value}: N = {n / 1e6:.1f}M matmul parameters, {config.num_layers} "
        f"layers; batch {batch_size} x {length} = {tokens} tokens; "
        f"{flops / 1e12:.3f} TFLOP per step (5 forwards)")

  variants = []  # (implementation, dtype, remat, attention, step function)
  with tempfile.TemporaryDirectory() as directory:
    if _TORCH.value:
      import torch

      weights.save_hf(model, directory, dtype=jnp.float32)
      print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
      for dtype in map(hardware.matmul_dtype, _TORCH_DTYPES.value):
        variants.append(
            ("torch+transformers", dtype, "-", "-", torch_step(pathlib.Path(directory), dtype,
                                                               batch)))
    for dtype in map(hardware.matmul_dtype, _DTYPES.value):
      for implementation in map(attention_lib.resolve, _ATTENTION.value):
        for remat in _REMAT.value:
          variants.append(("ours (jax)", dtype, remat, implementation,
                           ours_step(model, dtype, remat, implementation, batch)))
    measured = measure([variant[-1] for variant in variants], _WARMUP.value, timed_steps)
  rows = [(*variant[:-1], *times) for variant, times in zip(variants, measured)]
  torch_seconds = {row[1]: row[-1] for row in rows if row[0].startswith("torch")}

  print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
  print("| implementation | dtype | remat | attention | first step s | step s | tokens/s "
        "| GFLOP/s | of bf16 peak | of f32 peak | x torch |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for name, dtype, remat, implementation, first, seconds in rows:
    achieved = flops / seconds
    ratio = (f"{min(torch_seconds.values()) / seconds:.2f}x"
             if torch_seconds and name.startswith("ours") else "")
    print(f"| {name} | {dtype} | {remat} | {implementation} | {first:.2f} | {seconds:.2f} "
          f"| {tokens / seconds:.0f} "
          f"| {achieved / 1e9:.1f} | {achieved / peaks['bfloat16']:.1%} "
          f"| {achieved / peaks['float32']:.1%} | {ratio} |")
  print(f"\n(median of {timed_steps} rounds after {_WARMUP.value} warm-up; x torch = the fastest "
        "torch step time / ours, > 1 means ours is faster)")


if __name__ == "__main__":
  app.run(main)
