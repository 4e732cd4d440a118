"""Masked reductions over right-padded [B, T] token arrays.

`loss_mask` is 1 exactly on sampler-generated assistant tokens; every statistic in the RL code
is taken over those tokens only, so prompts, observations and padding never shift a mean.
"""

import jax
import jax.numpy as jnp


def masked_sum(values: jax.Array, loss_mask: jax.Array, axis=None) -> jax.Array:
  """sum(values * loss_mask) over `axis`; values at untrained positions never leak in."""
  return jnp.sum(jnp.where(loss_mask.astype(bool), values, 0.0), axis=axis)


def masked_mean(values: jax.Array, loss_mask: jax.Array, axis=None) -> jax.Array:
  """sum(values * mask) / sum(mask) over `axis`; 0 where the mask is empty (not NaN)."""
  count = jnp.sum(loss_mask.astype(jnp.float32), axis=axis)
  return masked_sum(values, loss_mask, axis) / jnp.maximum(count, 1.0)


def masked_whiten(values: jax.Array, loss_mask: jax.Array, eps: float = 1e-8) -> jax.Array:
  """(x - mean) / sqrt(var + eps) with mean and population variance over masked entries.

  Untrained positions come out as exactly 0. A batch whose masked entries are all equal (or
  has one) whitens to 0 rather than dividing by zero.
  """
  mean = masked_mean(values, loss_mask)
  variance = masked_mean(jnp.square(values - mean), loss_mask)
  whitened = (values - mean) * jax.lax.rsqrt(variance + eps)
  return jnp.where(loss_mask.astype(bool), whitened, 0.0)
