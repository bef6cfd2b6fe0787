"""Scaled dot-product attention a tile at a time, so the ``[..., L, S]`` scores never exist."""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class _Config(NamedTuple):
    """What the custom VJP needs to know that is not an array (hashable: a static argument)."""

    scale: float
    causal: bool
    dropout_p: float
    float_mask: bool
    queries: int  # L before padding
    keys: int  # S before padding
    q_tile: int
    k_tile: int


def scaled_dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                                 attn_mask: jax.Array | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                                 *, dropout_rng: jax.Array | None = None,
                                 chunk: int | tuple[int, int] = 256) -> jax.Array:
    """``torch.nn.functional.scaled_dot_product_attention``, computed in tiles (flash attention).

    The same arguments, layout and value as PyTorch's: ``softmax(query @ key.T * scale +
    mask) @ value`` over ``query (..., Hq, L, E)``, ``key (..., H, S, E)`` and ``value (..., H,
    S, Ev)``. The scores are made ``chunk`` queries by ``chunk`` keys at a time with an online
    softmax, in the forward and in the backward pass (FlashAttention-2's algorithm, which is
    also what PyTorch's CPU kernel runs), so neither the ``[..., L, S]`` scores nor the
    probabilities are kept for the backward: a ``jax.custom_vjp`` keeps the inputs, the
    output and each query's log-sum-exp. With ``is_causal`` the tiles above the diagonal are
    skipped. Scores, softmax and accumulation are in float32 (or wider); with bfloat16 inputs
    the probabilities and the scores' gradient are rounded to bfloat16 before their products,
    as PyTorch's kernel does.

    Args:
      query: ``(..., Hq, L, E)``.
      key: ``(..., H, S, E)``; ``H == Hq`` unless ``enable_gqa``. Leading axes broadcast.
      value: ``(..., H, S, Ev)``.
      attn_mask: optional, broadcastable to ``(..., Hq, L, S)``: boolean (``True`` takes
        part) or a float added to the scores (its gradient is computed, as for a learned bias).
      dropout_p: the probability of dropping an attention weight (needs ``dropout_rng``).
        The pattern depends on the key and the tile size, so it is not PyTorch's.
      is_causal: query ``i`` attends to keys ``j <= i`` (the top-left aligned mask PyTorch uses).
      scale: the scores' factor; ``E ** -0.5`` by default.
      enable_gqa: grouped-query attention: ``Hq`` a multiple of ``H``, query head ``h`` uses
        key/value head ``h // (Hq // H)``, without repeating key and value.
      dropout_rng: a PRNG key, used when ``dropout_p > 0``.
      chunk: queries and keys per tile, or ``(queries, keys)``; lengths it does not divide
        are padded. The ``[..., chunk, chunk]`` scores of a tile are the largest temporary.

    Returns:
      ``(..., Hq, L, Ev)`` in the query's dtype. A query no key may attend to gets zeros.

    Raises:
      ValueError: one line, for shapes that do not fit, a mask together with ``is_causal``
        (as PyTorch), ``dropout_p`` outside ``[0, 1)`` or without ``dropout_rng``, or ``chunk < 1``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from remat import ops
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 2, 8, 4))
      >>> p = jax.nn.softmax(q @ k.swapaxes(-1, -2) / 2.0 + jnp.where(jnp.tri(8), 0, -jnp.inf))
      >>> bool(jnp.allclose(ops.scaled_dot_product_attention(q, k, v, is_causal=True, chunk=4), p @ v,
      ...                   atol=1e-6))
      True
    """
    q_shape, k_shape, v_shape = jnp.shape(query), jnp.shape(key), jnp.shape(value)
    where = "scaled_dot_product_attention"
    if not (len(q_shape) == len(k_shape) == len(v_shape) >= 2):
        raise ValueError(f"{where}: query {q_shape}, key {k_shape} and value {v_shape} must be (..., L, E), "
                         "(..., S, E) and (..., S, Ev) with the same number of axes")
    if q_shape[-1] != k_shape[-1] or k_shape[-2] != v_shape[-2]:
        raise ValueError(f"{where}: query {q_shape}, key {k_shape} and value {v_shape} must be (..., L, E), "
                         "(..., S, E) and (..., S, Ev)")
    q_chunk, k_chunk = (chunk, chunk) if isinstance(chunk, int) else tuple(chunk)
    if min(q_chunk, k_chunk) < 1:
        raise ValueError(f"{where}: chunk must be at least 1, got {chunk}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{where}: dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0 and dropout_rng is None:
        raise ValueError(f"{where}: dropout_p={dropout_p} needs dropout_rng, a PRNG key (JAX has no global seed)")
    if attn_mask is not None and is_causal:
        raise ValueError(f"{where}: pass attn_mask or is_causal=True, not both (as PyTorch)")
    lead_axes = 3 if enable_gqa else 2
    if enable_gqa and (len(q_shape) < 3 or k_shape[-3] != v_shape[-3] or q_shape[-3] % k_shape[-3]):
        raise ValueError(f"{where}: enable_gqa needs (..., Hq, L, E) queries and (..., H, S, E) keys and "
                         f"values with Hq a multiple of H, got {q_shape}, {k_shape}, {v_shape}")
    try:
        lead = jnp.broadcast_shapes(q_shape[:-lead_axes], k_shape[:-lead_axes], v_shape[:-lead_axes])
    except ValueError:
        raise ValueError(f"{where}: the leading axes of query {q_shape}, key {k_shape} and value {v_shape} "
                         "do not broadcast") from None
    heads = (q_shape[-3],) if enable_gqa else ()
    full = (*lead, *heads, q_shape[-2], k_shape[-2])
    if attn_mask is not None:
        mask_shape = jnp.shape(attn_mask)
        dtype = jnp.result_type(attn_mask)
        if not (dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.floating)):
            raise ValueError(f"{where}: attn_mask must be boolean or floating, got {dtype}")
        if not _broadcasts(mask_shape, full):
            raise ValueError(f"{where}: attn_mask {mask_shape} does not broadcast to (..., Hq, L, S) = {full}")

    # the canonical form: query (*B, G, L, E), key (*B, S, E), value (*B, S, Ev), mask (*B, G, L, S)
    # broadcastable, where B are the batch axes (with the key/value heads) and G the query heads
    # that share a key/value head (1 without grouping)
    dtype = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(a, dtype) for a in (query, key, value))
    if enable_gqa:
        kv_heads = k_shape[-3]
        batch = (*lead, kv_heads)
        q = jnp.broadcast_to(query, (*lead, *q_shape[-3:])).reshape(
            *batch, q_shape[-3] // kv_heads, *q_shape[-2:])
    else:
        batch = lead
        q = jnp.broadcast_to(query, (*lead, *q_shape[-2:]))[..., None, :, :]
    k = jnp.broadcast_to(key, (*batch, *k_shape[-2:]))
    v = jnp.broadcast_to(value, (*batch, *v_shape[-2:]))
    mask = None if attn_mask is None else _canonical_mask(jnp.asarray(attn_mask), full, q.shape, enable_gqa)

    queries, keys = q_shape[-2], k_shape[-2]
    q_tile, k_tile = min(q_chunk, max(queries, 1)), min(k_chunk, max(keys, 1))
    q = _pad(q, -2, q_tile)
    k, v = _pad(k, -2, k_tile), _pad(v, -2, k_tile)
    if mask is not None:
        mask = _pad(_pad(mask, -2, q_tile), -1, k_tile)
    config = _Config(float(scale if scale is not None else q_shape[-1] ** -0.5), bool(is_causal), float(dropout_p),
                     mask is not None and mask.dtype != jnp.bool_, queries, keys, q_tile, k_tile)
    out: jax.Array = _attention(config, q, k, v, mask, dropout_rng)  # type: ignore[assignment]
    out = out[..., :queries, :]
    return out.reshape(*lead, *heads, queries, v_shape[-1]) if enable_gqa else out[..., 0, :, :]


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    return len(shape) <= len(target) and all(a in (1, b) for a, b in zip(shape[::-1], target[::-1], strict=False))


def _canonical_mask(mask: jax.Array, full: tuple[int, ...], q_shape: tuple[int, ...], grouped: bool) -> jax.Array:
    mask = mask.reshape((1,) * (len(full) - mask.ndim) + mask.shape)
    if not grouped:
        return mask[..., None, :, :]
    kv_heads, group = q_shape[-4], q_shape[-3]
    heads = (kv_heads, group) if mask.shape[-3] != 1 else (1, 1)
    return mask.reshape(*mask.shape[:-3], *heads, *mask.shape[-2:])


def _pad(x: jax.Array, axis: int, tile: int) -> jax.Array:
    """Pads ``axis`` to a multiple of ``tile`` (an axis of size 1 broadcasts and stays)."""
    size = x.shape[axis]
    if size == 1 and tile != 1:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, -size % tile)
    return jnp.pad(x, widths)


def _slice(x: jax.Array, axis: int, start: Any, size: int) -> jax.Array:
    """``size`` entries of ``axis`` from ``start``, or the whole axis where it broadcasts (size 1)."""
    return x if x.shape[axis] == 1 else lax.dynamic_slice_in_dim(x, start, size, axis % x.ndim)


def _key_tiles_seen_by(config: _Config, q_index: Any) -> Any:
    """The number of key tiles query tile ``q_index`` looks at (fewer under ``is_causal``)."""
    k_tiles = -(-config.keys // config.k_tile)
    if not config.causal:
        return k_tiles
    last_query = (q_index + 1) * config.q_tile - 1
    return jnp.minimum(last_query // config.k_tile + 1, k_tiles)


def _scores(config: _Config, q_i: jax.Array, k_j: jax.Array, mask: jax.Array | None, i: Any, j: Any,
            keys_first: bool = False) -> jax.Array:
    """The ``(*B, G, q_tile, k_tile)`` scores of query tile ``i`` against key tile ``j``, masked;
    with ``keys_first``, the same scores laid out ``(*B, k_tile, G, q_tile)``."""
    wide = jnp.promote_types(q_i.dtype, jnp.float32)
    if keys_first:
        s = jnp.einsum("...ke,...gqe->...kgq", k_j, q_i, preferred_element_type=wide) * config.scale
    else:
        s = jnp.einsum("...gqe,...ke->...gqk", q_i, k_j, preferred_element_type=wide) * config.scale
    q_pos = i * config.q_tile + jnp.arange(config.q_tile)[:, None]
    k_pos = j * config.k_tile + jnp.arange(config.k_tile)[None, :]
    allowed = k_pos < config.keys
    if config.causal:
        allowed = allowed & (k_pos <= q_pos)
    if mask is not None:
        tile = _slice(_slice(mask, -2, i * config.q_tile, config.q_tile), -1, j * config.k_tile, config.k_tile)
        if config.float_mask:
            s = s + (_keys_first(tile) if keys_first else tile).astype(wide)
        else:
            allowed = allowed & tile
    return jnp.where(_keys_first(allowed) if keys_first else allowed, s, -jnp.inf)


def _keys_first(tile: jax.Array) -> jax.Array:
    """A ``(..., q, k)`` tile laid out ``(..., k, 1 or G, q)``, as the backward's scores are."""
    tile = tile.reshape((1,) * max(0, 3 - tile.ndim) + tile.shape)
    return jnp.moveaxis(tile, -1, -3)


def _keep(config: _Config, rng: Any, i: Any, j: Any, shape: tuple[int, ...]) -> jax.Array:
    """Dropout's ``keep / (1 - p)`` factor for tile ``(i, j)``: the same in the forward and backward."""
    tile_rng = jax.random.fold_in(jax.random.fold_in(rng, i), j)
    keep = jax.random.bernoulli(tile_rng, 1.0 - config.dropout_p, shape)
    return keep.astype(jnp.float32) / (1.0 - config.dropout_p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config: _Config, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
               rng: jax.Array | None) -> jax.Array:
    return _forward(config, q, k, v, mask, rng)[0]


def _forward(config: _Config, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
             rng: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The output and each query's log-sum-exp (``-inf`` where no key is allowed)."""
    wide = jnp.promote_types(q.dtype, jnp.float32)
    rows = q.shape[:-1]  # (*B, G, padded L)
    out = jnp.zeros((*rows, v.shape[-1]), q.dtype)
    lse = jnp.zeros(rows, wide)

    def query_tile(i, state):
        out, lse = state
        q_i = lax.dynamic_slice_in_dim(q, i * config.q_tile, config.q_tile, q.ndim - 2)
        tile_rows = q_i.shape[:-1]

        def key_tile(j, carry):
            row_max, total, acc = carry
            k_j = lax.dynamic_slice_in_dim(k, j * config.k_tile, config.k_tile, k.ndim - 2)
            v_j = lax.dynamic_slice_in_dim(v, j * config.k_tile, config.k_tile, v.ndim - 2)
            s = _scores(config, q_i, k_j, mask, i, j)
            new_max = jnp.maximum(row_max, s.max(-1))
            shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)  # a row with no key yet stays at 0
            p = jnp.exp(s - shift[..., None])
            rescale = jnp.exp(row_max - shift)
            total = total * rescale + p.sum(-1)
            if config.dropout_p:
                p = p * _keep(config, rng, i, j, p.shape)
            pv = jnp.einsum("...gqk,...ke->...gqe", p.astype(v.dtype), v_j, preferred_element_type=wide)
            return new_max, total, acc * rescale[..., None] + pv

        start = (jnp.full(tile_rows, -jnp.inf, wide), jnp.zeros(tile_rows, wide),
                 jnp.zeros((*tile_rows, v.shape[-1]), wide))
        row_max, total, acc = lax.fori_loop(0, _key_tiles_seen_by(config, i), key_tile, start)
        seen = total > 0
        out_i = jnp.where(seen[..., None], acc / jnp.where(seen, total, 1.0)[..., None], 0.0)
        lse_i = jnp.where(seen, row_max + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
        out = lax.dynamic_update_slice_in_dim(out, out_i.astype(out.dtype), i * config.q_tile, out.ndim - 2)
        lse = lax.dynamic_update_slice_in_dim(lse, lse_i, i * config.q_tile, lse.ndim - 1)
        return out, lse

    return lax.fori_loop(0, q.shape[-2] // config.q_tile, query_tile, (out, lse))


def _attention_fwd(config, q, k, v, mask, rng):
    out, lse = _forward(config, q, k, v, mask, rng)
    return out, (q, k, v, mask, rng, out, lse)


def _attention_bwd(config, residuals, d_out):
    q, k, v, mask, rng, out, lse = residuals
    wide = jnp.promote_types(q.dtype, jnp.float32)
    d_out = d_out.astype(q.dtype)
    # D_i = sum_e dO_ie O_ie: the softmax backward's row term (FlashAttention-2, Algorithm 2)
    row_dot = jnp.einsum("...e,...e->...", d_out.astype(wide), out.astype(wide))
    q_tiles = q.shape[-2] // config.q_tile
    # In float32 dq is accumulated transposed, (*B, e, G, L): its products then take ds as it
    # is laid out. Not in bfloat16: XLA:CPU runs that product with its own dot kernel, which
    # has no bfloat16 operands with a float32 result (UNIMPLEMENTED at run time).
    dq_transposed = jnp.finfo(q.dtype).bits >= 32
    dq = jnp.zeros((*q.shape[:-3], q.shape[-1], *q.shape[-3:-1]) if dq_transposed else q.shape, wide)
    dq_axis = dq.ndim - 1 if dq_transposed else dq.ndim - 2
    dk, dv = jnp.zeros(k.shape, wide), jnp.zeros(v.shape, wide)
    d_mask = jnp.zeros(mask.shape, wide) if config.float_mask else None

    def key_tile(j, grads):
        dq, dk, dv, d_mask = grads
        k_j = lax.dynamic_slice_in_dim(k, j * config.k_tile, config.k_tile, k.ndim - 2)
        v_j = lax.dynamic_slice_in_dim(v, j * config.k_tile, config.k_tile, v.ndim - 2)

        def query_tile(i, carry):
            # The tile's scores are laid out keys first, (*B, k, G, q), and (in float32) dq is
            # accumulated transposed, so that no product contracts a score tile over its
            # leading axes: laid out as the forward's, XLA:CPU writes a transposed copy of both
            # p and ds on every tile.
            dq, dk_j, dv_j, d_mask = carry
            at = i * config.q_tile
            q_i = lax.dynamic_slice_in_dim(q, at, config.q_tile, q.ndim - 2)
            do_i = lax.dynamic_slice_in_dim(d_out, at, config.q_tile, d_out.ndim - 2)
            lse_i = lax.dynamic_slice_in_dim(lse, at, config.q_tile, lse.ndim - 1)[..., None, :, :]
            row_i = lax.dynamic_slice_in_dim(row_dot, at, config.q_tile, row_dot.ndim - 1)[..., None, :, :]
            s = _scores(config, q_i, k_j, mask, i, j, keys_first=True)
            p = jnp.where(jnp.isneginf(lse_i), 0.0, jnp.exp(s - lse_i))
            dp = jnp.einsum("...ke,...gqe->...kgq", v_j, do_i, preferred_element_type=wide)
            kept = p
            if config.dropout_p:
                keep = _keys_first(_keep(config, rng, i, j, (*q_i.shape[:-1], config.k_tile)))
                kept, dp = p * keep, dp * keep
            dv_j = dv_j + jnp.einsum("...kgq,...gqe->...ke", kept.astype(v.dtype), do_i, preferred_element_type=wide)
            ds = p * (dp - row_i)
            if d_mask is not None:
                d_mask = _add_tile(d_mask, jnp.moveaxis(ds, -3, -1), i * config.q_tile, j * config.k_tile)
            ds = ds.astype(q.dtype)  # rounded once before both products, as PyTorch's kernel does
            if dq_transposed:
                dq_i = jnp.einsum("...ke,...kgq->...egq", k_j, ds, preferred_element_type=wide) * config.scale
            else:
                dq_i = jnp.einsum("...kgq,...ke->...gqe", ds, k_j, preferred_element_type=wide) * config.scale
            dq = lax.dynamic_update_slice_in_dim(
                dq, lax.dynamic_slice_in_dim(dq, at, config.q_tile, dq_axis) + dq_i, at, dq_axis)
            dk_j = dk_j + jnp.einsum("...kgq,...gqe->...ke", ds, q_i, preferred_element_type=wide) * config.scale
            return dq, dk_j, dv_j, d_mask

        first = (j * config.k_tile) // config.q_tile if config.causal else 0
        start = (dq, jnp.zeros((*k.shape[:-2], config.k_tile, k.shape[-1]), wide),
                 jnp.zeros((*v.shape[:-2], config.k_tile, v.shape[-1]), wide), d_mask)
        dq, dk_j, dv_j, d_mask = lax.fori_loop(first, q_tiles, query_tile, start)
        dk = lax.dynamic_update_slice_in_dim(dk, dk_j, j * config.k_tile, dk.ndim - 2)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_j, j * config.k_tile, dv.ndim - 2)
        return dq, dk, dv, d_mask

    k_tiles = k.shape[-2] // config.k_tile
    dq, dk, dv, d_mask = lax.fori_loop(0, k_tiles, key_tile, (dq, dk, dv, d_mask))
    dq = jnp.moveaxis(dq, -3, -1) if dq_transposed else dq
    cast = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    return (*cast, None if d_mask is None else d_mask.astype(mask.dtype), None)


def _add_tile(total: jax.Array, tile: jax.Array, q_start: Any, k_start: Any) -> jax.Array:
    """Adds a score-gradient tile into the mask's gradient, summed over the axes the mask broadcasts."""
    tile = tile.reshape((1,) * (total.ndim - tile.ndim) + tile.shape)
    axes = tuple(a for a in range(total.ndim) if total.shape[a] == 1 and tile.shape[a] != 1)
    tile = tile.sum(axes, keepdims=True)
    starts = [0] * total.ndim
    if total.shape[-2] != 1:
        starts[-2] = q_start
    if total.shape[-1] != 1:
        starts[-1] = k_start
    current = lax.dynamic_slice(total, starts, tile.shape)
    return lax.dynamic_update_slice(total, current + tile, starts)


_attention.defvjp(_attention_fwd, _attention_bwd)
