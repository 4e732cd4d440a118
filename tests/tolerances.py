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
