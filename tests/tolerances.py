"""Tolerances for floats computed two ways, each derived from an error model.

Two evaluations of the same function that differ only in the order of their sums (another batch
composition, device count, process count, kernel library, or a CPU whose vector width changes how
a dot is blocked: AVX2 against AVX-512/AMX) differ by rounding alone. In f32, with unit roundoff
u = 2^-24, a dot product over K terms summed in another order moves by at most
gamma_K * sum|x_k w_k| (gamma_K = K u / (1 - K u); Higham, "Accuracy and Stability of Numerical
Algorithms", section 3.1), and typically by sqrt(K) u sum|x_k w_k|: the roundings are independent
and of either sign, so they add as a random walk. A decoder chains such dots; each of its L layers
adds its rounding to the residual stream relative to the stream's scale, and these independent
errors add as a random walk too. The logits therefore differ by about

    sqrt(L) * sqrt(K) * u * max|logits|,    K the widest dot (hidden or MLP width),

which the tiny test models (L = 2, K = 96, logits up to ~7) and SmolLM2 (L = 30, K = 1536) show:
1e-6 of the logits' scale against transformers. The tolerance is SAFETY times that estimate,
which covers the last bits of exp/rsqrt/sin/cos, which differ between libraries, and the
amplification through softmax and RMSNorm. A real defect (a wrong RoPE base, a norm epsilon, a
mask off by one position) moves logits by 1e-2 of their scale or more, far above it.
"""

import math

import numpy as np

F32_UNIT_ROUNDOFF = 2.0**-24
SAFETY = 8.0


def reordered_sum(num_terms: int) -> float:
  """Relative tolerance on a sum, mean or norm of num_terms f32 values added in another order."""
  return SAFETY * math.sqrt(num_terms) * F32_UNIT_ROUNDOFF


def reordered_logits(num_layers: int, widest_dot: int, logit_scale: float) -> float:
  """Absolute tolerance on logits of one f32 decoder evaluated with other summation orders."""
  return reordered_sum(num_layers * widest_dot) * logit_scale


def reordered_logprobs(num_layers: int, widest_dot: int, logit_scale: float) -> float:
  """The same for log-softmax outputs: logit_t - logsumexp(logits) carries two logits' errors."""
  return 2.0 * reordered_logits(num_layers, widest_dot, logit_scale)


def assert_attention_close(out, ref_out, grads, ref_grads, *, real, v, relative: float) -> None:
  """Attention outputs at the `real` (non-padding) queries within `relative` x max|v| of the
  reference, and each gradient within `relative` x its reference's largest entry: an output is
  a convex combination of values, and each gradient a sum of as many terms as the sum it
  differentiates."""
  np.testing.assert_allclose(
      np.asarray(out)[real],
      np.asarray(ref_out)[real], rtol=0, atol=relative * float(np.max(np.abs(v))))
  for name, got, want in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(got, want, rtol=0, atol=relative * float(np.max(np.abs(want))),
                               err_msg=f"d{name}")


BF16_UNIT_ROUNDOFF = 2.0**-9
# The matmuls a decoder layer runs per token for a gradient: 7 in the forward pass (q, k, v, o,
# gate, up, down) and two in the backward pass for each (the input's and the weight's gradient).
DOTS_PER_LAYER = 7 * 3
BF16_SAFETY = 3.0


def bf16_gradient(num_layers: int) -> float:
  """Relative error, ||g_bf16 - g_f32|| / ||g_f32||, of a decoder's gradient whose matmuls take
  bf16 inputs (f32 accumulation) against the same gradient in f32.

  Each matmul rounds both inputs to bf16, each by a relative error of at most u = 2^-9 and of
  variance u^2 / 3 (uniform), so a product term moves by a relative sqrt(2/3) u, and a dot of
  same-signed terms by as much (fewer where terms cancel). The roundings of successive matmuls
  are independent and of either sign, so through the L x DOTS_PER_LAYER matmuls on a gradient's
  path they add as a random walk:

      eps = sqrt(2/3) u sqrt(L * DOTS_PER_LAYER)

  (SmolLM2, L = 30: 0.040; measured 0.037 on a 2-core Intel Xeon without bf16 dot instructions,
  8 rows x 1,024 tokens of TextCraft demonstrations). The tolerance is BF16_SAFETY times that.
  A gradient within eps of the f32 one has cosine >= 1 - eps^2 / 2 and a norm within a factor
  1 +- eps of it; a bias, such as a matmul that rounds the wrong way or loses terms, scales
  every layer's gradient alike and exceeds it.
  """
  return (BF16_SAFETY * math.sqrt(2.0 / 3.0) * BF16_UNIT_ROUNDOFF *
          math.sqrt(num_layers * DOTS_PER_LAYER))
