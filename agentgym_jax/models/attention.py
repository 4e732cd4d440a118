"""Attention for the decoder: the dense reference, blockwise flash attention, the TPU kernel.

Three implementations of causal grouped-query self-attention over one packed row of tokens,
softmax(q k^T / sqrt(D) + mask) v, where query head h reads kv head h // G (G = H / K, HF's
repeat_kv order) and a query at index t sees the keys at indices s <= t of its own segment:

  dense   the scores [B, K, G, T, T] in f32, softmaxed and multiplied by v; XLA's autodiff keeps
          the probabilities for the backward pass. The reference, and the cached (sampling)
          path's attention, whose queries sit at each row's own cache slots.
  flash   blockwise attention in pure JAX with an online softmax and its own VJP (the
          FlashAttention-2 recurrences): neither pass holds more than one diagonal of
          [block, block] score tiles at a time, and tiles above the diagonal are never computed.
  splash  the Pallas splash-attention kernel that ships with JAX (TPU only; interpreted
          elsewhere, which is how the tests run it on CPU).

A decode step (one new query per row against the row's cached keys) runs `decode_attention`,
which reads each row's live slots only, chunk by chunk (a split-K flash decode over ragged
rows): its cost follows the tokens the rows hold, not the cache's size.

`choose` is the one place that picks an implementation by backend: splash on TPU, flash
elsewhere. Segment ids [B, T] (optional) restrict attention to keys of the query's segment; a
padded row carries its attention mask (1 real, 0 padding) as segment ids, which hides padding
keys from every real query. Every query sees at least itself, so no softmax row is empty.
Positions only enter through RoPE, applied to q and k before attention.

Shared prompts (`shared_prompt=True`, the learner's packed groups, agentgym_jax/batch.py): a
row holds a prompt (segment 0) and then several continuations of it (segments 1, 2, ...; -1 for
padding). A query at index t sees the key at s <= t when

  segment[s] == segment[t]  or  segment[s] == 0,

each continuation attends to the prompt and causally to itself, never to a sibling. Dense and
flash build this mask tile by tile from the segment ids; splash has no such mask (its mask
objects are static, one per shape, not per row), so a shared prompt runs flash on every
backend, TPU included.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from agentgym_jax import sharding

Array = jax.Array

IMPLEMENTATIONS = ("auto", "dense", "flash", "splash")
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Flash tiles: [block, block] scores per (row, head). 256 ran fastest on a 2-core CPU at T=512
# to 2048 (benchmarks/train_step.py --attention=flash); rows longer than MAX_BLOCKS blocks get
# larger tiles, so that the unrolled loop over block diagonals stays short.
FLASH_BLOCK = 256
MAX_BLOCKS = 32
# Splash tiles must be multiples of the TPU's 128 lanes; 512 is the kernel authors' choice for
# long rows.
SPLASH_BLOCK = 512
_LANES = 128
# Decode: cache slots a chunk reads per (row, kv head); 64 ran fastest of 32-256 on a 2-core CPU
# (SmolLM2, batch 32, rows of 65 tokens: a chunk of 256 reads 4x their slots and made the step
# 1.3x slower). And the logical axes of a layer's cache.
DECODE_CHUNK = 64
CACHE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")


def choose(name: str, backend: str | None = None) -> str:
  """The implementation that attention `name` runs on `backend` (default: JAX's): auto is
  splash on TPU and flash elsewhere."""
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"attention {name!r} is not one of {IMPLEMENTATIONS}")
  if name != "auto":
    return name
  return "splash" if (backend or jax.default_backend()) == "tpu" else "flash"


def causal_attention(q: Array, k: Array, v: Array, segment_ids: Array | None, *,
                     implementation: str = "auto", dtype: Any = jnp.float32,
                     block: int | None = None, shared_prompt: bool = False) -> Array:
  """Causal GQA self-attention [B, T, H, D] (f32) of q [B, T, H, D], k and v [B, T, K, D].

  segment_ids [B, T] (int) or None (one segment); `dtype` is the matmul input dtype (scores and
  softmax stay f32); `block` the flash tile (default: `flash_block(T)`); `shared_prompt`: segment
  0 is a prompt every segment sees (the module docstring; needs segment ids, runs flash in place
  of splash).
  """
  implementation = choose(implementation)
  if shared_prompt and segment_ids is None:
    raise ValueError("a shared prompt needs segment ids")
  if implementation == "dense":
    length = q.shape[1]
    mask = jnp.tril(jnp.ones((length, length), bool))[None]
    if segment_ids is not None:
      mask = mask & visible_segments(segment_ids[:, :, None], segment_ids[:, None, :],
                                     shared_prompt)
    mask = jnp.broadcast_to(mask, (q.shape[0], length, length))
    return dense_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, dtype)
  if implementation == "flash" or shared_prompt:
    return flash_attention(q, k, v, segment_ids, dtype=dtype, block=block
                           or flash_block(q.shape[1]), shared_prompt=shared_prompt)
  return splash_attention(q, k, v, segment_ids, dtype=dtype)


def visible_segments(query_segments: Array, key_segments: Array, shared_prompt: bool) -> Array:
  """Whether a query of one segment may see a key of another (broadcast; causality aside):
  the same segment, or with a shared prompt also the prompt's segment 0."""
  same = query_segments == key_segments
  return same | (key_segments == 0) if shared_prompt else same


def dense_attention(q: Array, k: Array, v: Array, mask: Array, dtype: Any) -> Array:
  """Grouped-query attention with the scores materialised.

  q [B, T, H, D], k and v [B, K, S, D] with H = K * G (query head h uses kv head h // G, as HF's
  repeat_kv), mask [B, T, S]. Scores and softmax in f32.
  """
  batch, length, heads, head_dim = q.shape
  kv_heads = k.shape[1]
  # q as [B, K, G, T, D]: the scores' order [B, K, G, T, S] is then the matmul's natural output
  # order (batch dims, then q's rows, then k's), which the mask and softmax read as it is; from
  # q as [B, T, K, G, D] XLA:CPU wrote every score again in a transposing copy.
  q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim).transpose(0, 2, 3, 1, 4)
  scores = dot("bkgtd,bksd->bkgts", q, k, dtype) / math.sqrt(head_dim)
  scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1)
  # The plain batched-matmul order (batch dims, then probs' rows, then v's columns): XLA:CPU
  # hands it to its bf16 matmul library, while an output in another order can be rewritten into
  # a dot with v as the left operand that only the (f32-only) fallback takes.
  out = dot("bkgts,bksd->bkgtd", probs, v, dtype)
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, head_dim)


def decode_attention(q: Array, k_bits: Array, v_bits: Array, visible: Array, cache_dtype: Any,
                     dtype: Any, chunk: int = DECODE_CHUNK, rows: Array | None = None) -> Array:
  """One query per row against the row's own cached keys: [B, H, D] (f32).

  q [B, H, D]; k_bits and v_bits [N, K, S, D], one layer's cache as the raw bits of
  `cache_dtype` (see decoder.KVCache); query row b reads cache row rows[b] (default: b, with
  N = B), attending to its slots [0, visible[b]), none when visible[b] = 0 (its output is then
  0). Query head h reads kv head h // G (G = H / K).

  Only live slots are read. Row b's slots are cut into c_b = ceil(visible[b] / chunk) chunks;
  the chunks of all rows, n = sum_b c_b work items, are taken B at a time (a loop of
  ceil(n / B) steps), each item gathering its [K, chunk, D] keys and values. Per item i of row b,
  with scores s_i = q_b k_i^T / sqrt(D) (slots outside the chunk or past visible[b] masked),

    m_i = max(s_i),   l_i = sum(exp(s_i - m_i)),   a_i = exp(s_i - m_i) v_i,

  and the row keeps M_b = max_i m_i, L_b = sum_i l_i exp(m_i - M_b), A_b = sum_i a_i exp(m_i - M_b),
  rescaled by exp(M_old - M_new) when an item raises M_b; out_b = A_b / L_b. So a decode step
  reads sum_b c_b chunks, not B times the longest row nor the whole cache. Under a mesh each
  device runs this on its rows and kv heads (shard_map).
  """
  batch, heads, head_dim = q.shape
  kv_heads = k_bits.shape[1]
  q = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
  run = functools.partial(_decode_rows, cache_dtype=jnp.dtype(cache_dtype), dtype=jnp.dtype(dtype),
                          chunk=chunk)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    rows = jnp.arange(batch) if rows is None else rows
    return run(q, k_bits, v_bits, visible, rows).reshape(batch, heads, head_dim)
  cache_spec = sharding.logical_to_spec(CACHE_AXES, k_bits.shape, mesh)
  row_axes, kv = cache_spec[0], cache_spec[1]
  if rows is not None and row_axes is not None:
    raise ValueError("query rows read other cache rows only when the mesh does not split the "
                     "rows (each device attends over the rows it holds)")
  cache_spec = jax.sharding.PartitionSpec(row_axes, kv, None, None)  # A row's slots on one shard.
  q_spec = jax.sharding.PartitionSpec(row_axes, kv, None, None)
  rows = jnp.arange(batch) if rows is None else rows  # Global indices: local when rows split.
  local = lambda q, k_bits, v_bits, visible, rows: run(
      q, k_bits, v_bits, visible, rows if row_axes is None else jnp.arange(q.shape[0]))
  row_spec = jax.sharding.PartitionSpec(row_axes)
  mapped = jax.shard_map(local, in_specs=(q_spec, cache_spec, cache_spec, row_spec, row_spec),
                         out_specs=q_spec, check_vma=False)
  return mapped(q, k_bits, v_bits, visible, rows).reshape(batch, heads, head_dim)


def _decode_rows(q: Array, k_bits: Array, v_bits: Array, visible: Array, rows: Array, *,
                 cache_dtype: Any, dtype: Any, chunk: int) -> Array:
  """`decode_attention` on the rows and kv heads at hand: q [B, K, G, D] -> [B, K, G, D],
  query row b against cache row rows[b]."""
  batch, kv_heads, groups, head_dim = q.shape
  slots = k_bits.shape[2]
  chunk = min(chunk, slots)
  chunks = -(-visible // chunk)  # [B]
  ends = jnp.cumsum(chunks)  # Item i belongs to the first row whose end is > i.
  firsts = ends - chunks

  def gather(bits: Array, rows: Array, offsets: Array) -> Array:
    """[items, K, chunk, D] in cache_dtype: slots offsets[i].. of row rows[i]."""
    take = lambda row, offset: jax.lax.dynamic_slice(bits, (row, 0, offset, 0),
                                                     (1, kv_heads, chunk, head_dim))[0]
    return jax.lax.bitcast_convert_type(jax.vmap(take)(rows, offsets), cache_dtype)

  def body(carry):
    first, peak, total, acc = carry
    items = first + jnp.arange(batch)
    row = jnp.sum(ends[None, :] <= items[:, None], axis=1)  # batch past the last item: dropped.
    safe_row = jnp.minimum(row, batch - 1)
    begin = (items - firsts[safe_row]) * chunk  # The chunk's first slot.
    offset = jnp.minimum(begin, slots - chunk)  # A last chunk past the end is read shifted.
    cache_row = rows[safe_row]
    keys, values = gather(k_bits, cache_row, offset), gather(v_bits, cache_row, offset)
    scores = dot("ikgd,ikcd->ikgc", q[safe_row], keys, dtype) / math.sqrt(head_dim)
    slot = offset[:, None] + jnp.arange(chunk)
    seen = (slot >= begin[:, None]) & (slot < visible[safe_row][:, None])
    scores = jnp.where(seen[:, None, None, :], scores, MASK_VALUE)
    item_peak = jnp.max(scores, axis=-1)  # [items, K, G]: a real score (a chunk sees a slot).
    probs = jnp.exp(scores - item_peak[..., None])
    new_peak = peak.at[row].max(item_peak, mode="drop")
    scale = jnp.exp(item_peak - new_peak[safe_row])
    rescale = jnp.exp(peak - new_peak)
    total = (total * rescale).at[row].add(jnp.sum(probs, axis=-1) * scale, mode="drop")
    acc = (acc * rescale[..., None]).at[row].add(
        dot("ikgc,ikcd->ikgd", probs, values, dtype) * scale[..., None], mode="drop")
    return first + batch, new_peak, total, acc

  peak = jnp.full((batch, kv_heads, groups), MASK_VALUE, jnp.float32)
  _, _, total, acc = jax.lax.while_loop(
      lambda carry: carry[0] < ends[-1], body,
      (jnp.int32(0), peak, jnp.zeros_like(peak), jnp.zeros(q.shape, jnp.float32)))
  return acc / jnp.where(total > 0, total, 1.0)[..., None]


def dot(spec: str, x: Array, w: Array, dtype: Any) -> Array:
  """einsum with inputs cast to `dtype` and f32 accumulation (an f32 result).

  With a narrower `dtype` (bf16) the backward pass's two matmuls also take `dtype` inputs, the
  incoming cotangent cast like the forward's inputs, with f32 accumulation, as mixed-precision
  training does (torch.autocast): JAX's own transpose would multiply the f32 cotangent by the
  upcast weights, f32 matmuls at a quarter of a bf16 matmul's speed on AMX (XLA:CPU runs
  bf16 x bf16 -> bf16 slower still, hence the f32 results). The cotangents of x and w come
  back in their own dtypes. Every index of `spec` appears in two of its three terms (no
  index is summed within one operand), so each gradient is one einsum.
  """
  if jnp.dtype(dtype).itemsize >= 4:
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  return _narrow_dot(_explicit(spec, x.ndim, w.ndim), jnp.dtype(dtype), x, w)


def _explicit(spec: str, x_ndim: int, w_ndim: int) -> str:
  """`spec` with its ellipsis (if any) spelled out as letters it does not use."""
  if "..." not in spec:
    return spec
  inputs, output = spec.split("->")
  x_spec, w_spec = inputs.split(",")
  named = x_spec.replace("...", "") if "..." in x_spec else w_spec.replace("...", "")
  free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in spec]
  ndim = x_ndim if "..." in x_spec else w_ndim
  return spec.replace("...", "".join(free[:ndim - len(named)]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _narrow_dot(spec: str, dtype: Any, x: Array, w: Array) -> Array:
  return _narrow_dot_forward(spec, dtype, x, w)[0]


def _narrow_dot_forward(spec: str, dtype: Any, x: Array, w: Array):
  narrow_x, narrow_w = x.astype(dtype), w.astype(dtype)
  out = jnp.einsum(spec, narrow_x, narrow_w, preferred_element_type=jnp.float32)
  # The narrow inputs are kept as raw bits: a layer scan stacks its residuals, and XLA:CPU
  # converts a stacked bf16 array to f32 and back around each layer's write (remat=none ran
  # 1.8x slower than full). Zero-size arrays carry the primal dtypes to the backward pass.
  kinds = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
  return out, (to_bits(narrow_x), to_bits(narrow_w), *kinds)


def _narrow_dot_backward(spec: str, dtype: Any, residuals, g: Array):
  x_bits, w_bits, x_kind, w_kind = residuals
  narrow_x, narrow_w = (jax.lax.bitcast_convert_type(bits, dtype) for bits in (x_bits, w_bits))
  (x_spec, w_spec), out_spec = spec.split("->")[0].split(","), spec.split("->")[1]
  g = g.astype(dtype)
  dx = jnp.einsum(f"{out_spec},{w_spec}->{x_spec}", g, narrow_w, preferred_element_type=jnp.float32)
  dw = smaller_first(f"{x_spec},{out_spec}->{w_spec}", narrow_x, g)
  return dx.astype(x_kind.dtype), dw.astype(w_kind.dtype)


_narrow_dot.defvjp(_narrow_dot_forward, _narrow_dot_backward)


def smaller_first(spec: str, a: Array, b: Array) -> Array:
  """einsum(spec, a, b) with f32 accumulation, the smaller operand passed first.

  When both operands hold the indices summed over ahead of their kept ones (a weight gradient
  sums over the tokens of its input and its output's cotangent; attention's dv and dk over the
  query rows), XLA:CPU copies the dot's first operand into a transposed layout: let that be the
  smaller one. The result, in the dot's order, goes to `spec`'s behind an optimization
  barrier: folded into the dot, the transpose would bring the larger operand's copy back (and
  XLA:CPU would hand the dot to a kernel without bf16).
  """
  (a_spec, b_spec), out_spec = spec.split("->")[0].split(","), spec.split("->")[1]
  if a.size <= b.size:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
  batch = [c for c in b_spec if c in a_spec and c in out_spec]
  kept = lambda operand: [c for c in operand if c in out_spec and c not in batch]
  natural = "".join(batch + kept(b_spec) + kept(a_spec))
  result = jnp.einsum(f"{b_spec},{a_spec}->{natural}", b, a, preferred_element_type=jnp.float32)
  if natural == out_spec:
    return result
  return jnp.einsum(f"{natural}->{out_spec}", jax.lax.optimization_barrier(result))


def bits_dtype(dtype: Any) -> Any:
  """The unsigned integer type as wide as `dtype`."""
  return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def to_bits(x: Array) -> Array:
  """x's raw bits: XLA:CPU slices and updates stacked 16-bit floats through f32 copies of the
  whole stack, and integer arrays in place."""
  return jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype))


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


# --- flash: blockwise attention with an online softmax


def flash_block(length: int) -> int:
  """The flash tile for rows of `length` tokens: FLASH_BLOCK, or larger so that a row has at
  most MAX_BLOCKS blocks (a multiple of 8)."""
  return max(FLASH_BLOCK, _round_up(-(-length // MAX_BLOCKS), 8))


def flash_attention(q: Array, k: Array, v: Array, segment_ids: Array | None = None, *,
                    dtype: Any = jnp.float32, block: int = FLASH_BLOCK,
                    shared_prompt: bool = False) -> Array:
  """Causal GQA self-attention [B, T, H, D] (f32), blockwise; see `causal_attention`.

  The row is cut into n = ceil(T / block) blocks (the tail padded; causality hides padded keys
  from every real query). Query block i attends to key blocks j <= i; the pairs are visited one
  block diagonal d = i - j at a time, each diagonal a batch of n - d independent [block, block]
  tiles, so every matmul is large and none of them lies above the diagonal. Per query row, with
  s_j = q k_j^T / sqrt(D) (masked) and v_j the tiles seen so far, the online softmax keeps

    m = max_j max(s_j),   l = sum_j sum(exp(s_j - m)),   acc = sum_j exp(s_j - m) v_j,

  rescaling l and acc by exp(m_old - m_new) when m grows; out = acc / l, and the backward pass
  keeps only out and lse = m + log(l) (FlashAttention-2). The diagonal d = 0 comes first: it
  holds every query's own key, so m is a real score from the start and l >= 1.

  Segments mask each tile by `visible_segments` of its query and key ids (with
  `shared_prompt`, a key of segment 0 is visible to every later query), so the mask is never
  more than one [block, block] tile per (row, diagonal) either. The tail padding of the last
  block carries segment 0, which causality hides: its keys come after every real query.
  """
  return _flash(q, k, v, segment_ids, jnp.dtype(dtype), block, shared_prompt)


def _blocks(x: Array, block: int) -> Array:
  """x [B, T, ...] padded to whole blocks: [B, n, block, ...]."""
  batch, length = x.shape[:2]
  n = -(-length // block)
  x = jnp.pad(x, [(0, 0), (0, n * block - length)] + [(0, 0)] * (x.ndim - 2))
  return x.reshape(batch, n, block, *x.shape[2:])


def _block_q(q: Array, kv_heads: int, block: int) -> Array:
  """q [B, T, H, D] -> [n, B, K, G, block, D] (query head h = k * G + g)."""
  q = _blocks(q, block)
  batch, n, _, heads, head_dim = q.shape
  q = q.reshape(batch, n, block, kv_heads, heads // kv_heads, head_dim)
  return q.transpose(1, 0, 3, 4, 2, 5)


def _block_kv(x: Array, block: int) -> Array:
  """k or v [B, T, K, D] -> [n, B, K, block, D]."""
  return _blocks(x, block).transpose(1, 0, 3, 2, 4)


def _unblock_q(x: Array, length: int) -> Array:
  """[n, B, K, G, block, D] -> [B, length, K * G, D]."""
  n, batch, kv_heads, groups, block, head_dim = x.shape
  x = x.transpose(1, 0, 4, 2, 3, 5).reshape(batch, n * block, kv_heads * groups, head_dim)
  return x[:, :length]


def _unblock_kv(x: Array, length: int) -> Array:
  """[n, B, K, block, D] -> [B, length, K, D]."""
  n, batch, kv_heads, block, head_dim = x.shape
  return x.transpose(1, 0, 3, 2, 4).reshape(batch, n * block, kv_heads, head_dim)[:, :length]


def _diagonal_scores(q: Array, k: Array, segment_ids: Array | None, d: int, dtype: Any,
                     shared_prompt: bool) -> Array:
  """Masked scores [n - d, B, K, G, block, block] of query blocks d.. against key blocks ..n-d
  (block diagonal d)."""
  n, block, head_dim = q.shape[0], q.shape[4], q.shape[5]
  scores = dot("nbkgqd,nbksd->nbkgqs", q[d:], k[:n - d], dtype) / math.sqrt(head_dim)
  visible = None
  if d == 0:  # Only the diagonal tiles cut through the causal boundary.
    visible = jnp.tril(jnp.ones((block, block), bool))
  if segment_ids is not None:
    same = visible_segments(segment_ids[d:, :, None, None, :, None],
                            segment_ids[:n - d, :, None, None, None, :], shared_prompt)
    visible = same if visible is None else same & visible
  return scores if visible is None else jnp.where(visible, scores, MASK_VALUE)


def _after(x: Any, *probes: Array) -> Any:
  """x (arrays [n, B, K, G, ...]), made to wait for the arrays the previous block diagonal wrote
  by adding an exact zero read from `probes`, one element of each per (row, head): [B, K, G]
  or [B, K, 1], taken where that diagonal wrote.

  The diagonals' score tiles do not depend on each other, and XLA:CPU drops optimization
  barriers before it schedules: without a data dependency it computes every diagonal's tiles
  (the whole T x T) before reducing any. isnan(.) * 0 is 0 whatever the probes hold, and reads
  only this device's rows and heads (no collective on a mesh).
  """
  zero = sum(jnp.isnan(probe).astype(jnp.float32) for probe in probes) * 0.0
  return jax.tree.map(lambda a: a + zero[None, :, :, :, None, None].astype(a.dtype), x)


def _pv(p: Array, v: Array, dtype: Any) -> Array:
  """p [m, B, K, G, bq, bk] times v [m, B, K, bk, D]: [m, B, K, G, bq, D] in f32."""
  return dot("nbkgqs,nbksd->nbkgqd", p, v, dtype)


def _flash_forward(q: Array, k: Array, v: Array, segment_ids: Array | None, dtype: Any, block: int,
                   shared_prompt: bool):
  """(out [B, T, H, D], residuals) of `flash_attention`."""
  length, kv_heads = q.shape[1], k.shape[2]
  qb, kb, vb = _block_q(q, kv_heads, block), _block_kv(k, block), _block_kv(v, block)
  sb = None if segment_ids is None else _blocks(segment_ids, block).transpose(1, 0, 2)
  n = qb.shape[0]
  s = _diagonal_scores(qb, kb, sb, 0, dtype, shared_prompt)
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - m[..., None])
  denominator = jnp.sum(p, axis=-1)
  acc = _pv(p, vb, dtype)
  for d in range(1, n):
    # The previous diagonal wrote query blocks d - 1.., the last one among them.
    queries = _after(qb, acc[-1, ..., 0, 0], denominator[-1, ..., 0])
    s = _diagonal_scores(queries, kb, sb, d, dtype, shared_prompt)
    m_new = jnp.maximum(m[d:], jnp.max(s, axis=-1))
    alpha = jnp.exp(m[d:] - m_new)
    p = jnp.exp(s - m_new[..., None])
    denominator = denominator.at[d:].set(alpha * denominator[d:] + jnp.sum(p, axis=-1))
    acc = acc.at[d:].set(alpha[..., None] * acc[d:] + _pv(p, vb[:n - d], dtype))
    m = m.at[d:].set(m_new)
  out = acc / denominator[..., None]
  lse = m + jnp.log(denominator)
  return _unblock_q(out, length), (qb, kb, vb, sb, out, lse)


def _flash_backward(dtype: Any, block: int, shared_prompt: bool, residuals, d_out: Array):
  """Cotangents of q, k, v (and None for the segment ids) of `flash_attention`.

  With p = exp(s - lse) recomputed tile by tile and delta = rowsum(dout * out):
    dv_j = sum_i p_ij^T dout_i,  ds_ij = p_ij (dout_i v_j^T - delta_i) / sqrt(D),
    dq_i = sum_j ds_ij k_j,      dk_j = sum_i ds_ij^T q_i.
  """
  qb, kb, vb, sb, out, lse = residuals
  n, head_dim, length = qb.shape[0], qb.shape[-1], d_out.shape[1]
  do = _block_q(d_out, kb.shape[2], block).astype(jnp.float32)
  delta = jnp.sum(do * out, axis=-1)
  dq = jnp.zeros(qb.shape, jnp.float32)
  dk = jnp.zeros(kb.shape, jnp.float32)
  dv = jnp.zeros(vb.shape, jnp.float32)
  for d in range(n):
    # The previous diagonal wrote dq's query blocks d - 1.. and dk's, dv's key blocks ..n - d.
    queries, d_queries = (qb, do) if d == 0 else _after(
        (qb, do), dq[-1, ..., 0, 0], dk[0, ..., None, 0, 0], dv[0, ..., None, 0, 0])
    p = jnp.exp(_diagonal_scores(queries, kb, sb, d, dtype, shared_prompt) - lse[d:][..., None])
    dv = dv.at[:n - d].add(
        smaller_first("nbkgqs,nbkgqd->nbksd", p.astype(dtype), d_queries[d:].astype(dtype)))
    dp = dot("nbkgqd,nbksd->nbkgqs", d_queries[d:], vb[:n - d], dtype)
    ds = p * (dp - delta[d:][..., None]) / math.sqrt(head_dim)
    dq = dq.at[d:].add(_pv(ds, kb[:n - d], dtype))
    dk = dk.at[:n - d].add(
        smaller_first("nbkgqs,nbkgqd->nbksd", ds.astype(dtype), queries[d:].astype(dtype)))
  return (_unblock_q(dq, length).astype(qb.dtype), _unblock_kv(dk, length).astype(kb.dtype),
          _unblock_kv(dv, length).astype(vb.dtype), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q: Array, k: Array, v: Array, segment_ids: Array | None, dtype: Any, block: int,
           shared_prompt: bool) -> Array:
  return _flash_forward(q, k, v, segment_ids, dtype, block, shared_prompt)[0]


_flash.defvjp(_flash_forward, _flash_backward)

# --- splash: the Pallas TPU kernel


def splash_attention(q: Array, k: Array, v: Array, segment_ids: Array | None, *,
                     dtype: Any = jnp.float32, interpret: bool | None = None) -> Array:
  """Causal GQA self-attention [B, T, H, D] (f32) by JAX's Pallas splash-attention kernel.

  The kernel runs one row at a time (vmapped) on q [H, T, D], k and v [K, T, D] with T padded
  to its tile; q is scaled by 1/sqrt(D) before the kernel, which has no scale of its own. Under
  a mesh it runs per device on its shard (shard_map): rows split over the batch axes, heads
  over tensor when both head counts divide. `interpret` (default: off TPU) runs the kernel
  in Pallas's interpreter.
  """
  if interpret is None:
    interpret = jax.default_backend() != "tpu"
  mesh = jax.sharding.get_abstract_mesh()
  run = functools.partial(_splash_rows, dtype=jnp.dtype(dtype), interpret=interpret)
  if mesh.empty:
    return run(q, k, v, segment_ids)
  q_spec = sharding.logical_to_spec(("batch", "seq", "activation_heads", "head_dim"), q.shape, mesh)
  kv_spec = sharding.logical_to_spec(("batch", "seq", "activation_kv_heads", "head_dim"), k.shape,
                                     mesh)
  if q_spec[2] != kv_spec[2]:  # Heads and kv heads must split alike, or not at all.
    q_spec = jax.sharding.PartitionSpec(*q_spec[:2], None, None)
    kv_spec = jax.sharding.PartitionSpec(*kv_spec[:2], None, None)
  rows = jax.sharding.PartitionSpec(q_spec[0], None)
  mapped = jax.shard_map(run,
                         in_specs=(q_spec, kv_spec, kv_spec, None if segment_ids is None else rows),
                         out_specs=q_spec, check_vma=False)
  return mapped(q, k, v, segment_ids)


def _splash_rows(q: Array, k: Array, v: Array, segment_ids: Array | None, *, dtype: Any,
                 interpret: bool) -> Array:
  """`splash_attention` on the rows (and heads) at hand."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as kernel_lib, splash_attention_mask as mask_lib)

  batch, length, heads, head_dim = q.shape
  block = min(SPLASH_BLOCK, _round_up(length, _LANES))
  padded = _round_up(length, block)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
  heads_first = lambda x: pad(x).astype(dtype).transpose(0, 2, 1, 3)
  q, k, v = heads_first(q / math.sqrt(head_dim)), heads_first(k), heads_first(v)
  sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                                block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                                block_q_dq=block, block_kv_dq=block)
  kernel = kernel_lib.make_splash_mha(
      mask_lib.MultiHeadMask([mask_lib.CausalMask((padded, padded))] * heads), block_sizes=sizes,
      head_shards=1, q_seq_shards=1, interpret=interpret)
  if segment_ids is None:
    out = jax.vmap(kernel)(q, k, v)
  else:
    ids = pad(segment_ids)
    out = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, kernel_lib.SegmentIds(ids, ids)))(q, k, v,
                                                                                          ids)
  return out.transpose(0, 2, 1, 3)[:, :length].astype(jnp.float32)
