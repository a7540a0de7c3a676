"""Paged K/V in the shared arena: scatter, gather and bit-exact verification of blocks,
and decode attention over them (paged with an online softmax, or a contiguous reference)."""

from __future__ import annotations

import math
import operator

import numpy as np

from kvshm.workers.model import nonneg_int, positive_int

# Arena layout: ``kv[block, layer, 0 (K) | 1 (V), slot, kv_head, dim]``. Token
# ``pos`` of a request lives in ``block_ids[pos // block_size]`` at slot
# ``pos % block_size``. Block 0 is the null block: never written or read, and a
# block-table entry 0 marks a block dropped by sliding-window attention.

__all__ = [
    "attention",
    "mismatching_blocks",
    "paged_attention",
    "read_kv",
    "write_kv",
]

NULL_BLOCK = 0


# ----------------------------------------------------------------- arena I/O


def _check_arena(kv_arena: np.ndarray, block_size: int) -> None:
    if not isinstance(kv_arena, np.ndarray) or kv_arena.ndim != 6 or kv_arena.shape[2] != 2:
        shape = getattr(kv_arena, "shape", None)
        raise ValueError(
            "kv_arena must be an array [num_blocks, num_layers, 2, block_size, "
            f"num_kv_heads, head_size], got shape {shape}"
        )
    bs = positive_int(block_size, "block_size")
    if kv_arena.shape[3] != bs:
        raise ValueError(f"block_size={bs} does not match the arena's {kv_arena.shape[3]}")


def _block_runs(kv_arena, block_ids, block_size: int, start: int, n: int):
    """(table index, block id, first slot, slot end, first token offset) per block
    holding tokens start..start+n-1; every entry must be a real block."""
    num_blocks = kv_arena.shape[0]
    if n == 0:
        return []
    first, last = start // block_size, (start + n - 1) // block_size
    if last >= len(block_ids):
        raise ValueError(
            f"block table has {len(block_ids)} entries, tokens up to {start + n - 1} "
            f"need {last + 1}"
        )
    runs = []
    for b in range(first, last + 1):
        bid = operator.index(block_ids[b])
        if bid == NULL_BLOCK:
            raise ValueError(f"block table entry {b} is the null block inside the range")
        if not 0 < bid < num_blocks:
            raise ValueError(f"block table entry {b}: block id {bid} out of range [1, {num_blocks})")
        lo = max(start, b * block_size)
        hi = min(start + n, (b + 1) * block_size)
        runs.append((b, bid, lo - b * block_size, hi - b * block_size, lo - start))
    return runs


def _check_kv_pair(kv_arena: np.ndarray, k: np.ndarray, v: np.ndarray) -> int:
    _, L, _, _, H, D = kv_arena.shape
    for name, a in (("k", k), ("v", v)):
        if not isinstance(a, np.ndarray) or a.ndim != 4 or a.shape[0] != L or a.shape[2:] != (H, D):
            raise ValueError(
                f"{name} must be [num_layers={L}, n, num_kv_heads={H}, head_size={D}], "
                f"got {getattr(a, 'shape', None)}"
            )
        if a.dtype != kv_arena.dtype:
            raise ValueError(f"{name} dtype {a.dtype} differs from the arena's {kv_arena.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} differ in shape")
    return k.shape[1]


def write_kv(kv_arena: np.ndarray, block_ids, block_size: int, start: int,
             k: np.ndarray, v: np.ndarray) -> None:
    """Scatter K/V of tokens ``start..start+n-1`` into their blocks (one copy per block).

    Args:
        kv_arena: the arena ``[num_blocks, L, 2, block_size, H, D]``.
        block_ids: the request's block table.
        block_size: tokens per block (must match the arena).
        start: position of the first token.
        k, v: ``[L, n, H, D]`` in the arena's dtype (as :meth:`workers.model.TinyModel.kv`).

    Raises:
        ValueError: shape/dtype mismatch, a table too short, or a null or
            out-of-range block id where a token must be written.
    """
    _check_arena(kv_arena, block_size)
    start = nonneg_int(start, "start")
    n = _check_kv_pair(kv_arena, k, v)
    for _, bid, s0, s1, t0 in _block_runs(kv_arena, block_ids, block_size, start, n):
        t1 = t0 + (s1 - s0)
        kv_arena[bid, :, 0, s0:s1] = k[:, t0:t1]
        kv_arena[bid, :, 1, s0:s1] = v[:, t0:t1]


def read_kv(kv_arena: np.ndarray, block_ids, block_size: int, start: int,
            n: int) -> tuple[np.ndarray, np.ndarray]:
    """Gather K/V of tokens ``start..start+n-1`` from their blocks.

    Returns:
        ``(k, v)``, each a new ``[L, n, H, D]`` array in the arena's dtype.

    Raises:
        ValueError: as :func:`write_kv`.
    """
    _check_arena(kv_arena, block_size)
    start = nonneg_int(start, "start")
    n = nonneg_int(n, "n")
    _, L, _, _, H, D = kv_arena.shape
    runs = _block_runs(kv_arena, block_ids, block_size, start, n)   # (checks the table)
    if not runs:
        return (np.empty((L, 0, H, D), dtype=kv_arena.dtype),) * 2
    # One gather of the whole blocks (numpy's fancy indexing, in C), then
    # the tokens' slice: a long prefix is many blocks.
    ids = [bid for _, bid, _, _, _ in runs]
    blocks = kv_arena[ids]                                 # [nb, L, 2, bs, H, D]
    off = start - runs[0][0] * block_size
    k = blocks[:, :, 0].transpose(1, 0, 2, 3, 4).reshape(L, -1, H, D)[:, off:off + n]
    v = blocks[:, :, 1].transpose(1, 0, 2, 3, 4).reshape(L, -1, H, D)[:, off:off + n]
    return k, v


def mismatching_blocks(kv_arena: np.ndarray, block_ids, block_size: int,
                       k: np.ndarray, v: np.ndarray, start: int = 0) -> list[int]:
    """Blocks whose stored K/V are not bit-identical to ``k``/``v``.

    Compares raw bits (integer views), so -0.0 vs 0.0 differ and equal NaNs
    match. Only the slots of tokens ``start..start+n-1`` are compared.

    Args:
        kv_arena, block_ids, block_size: as :func:`write_kv`.
        k, v: expected ``[L, n, H, D]`` K/V (arena dtype) of tokens from ``start``.
        start: position of the first token.

    Returns:
        Sorted indices into ``block_ids`` of the differing blocks ([] if all match).

    Raises:
        ValueError: as :func:`write_kv`.
    """
    _check_arena(kv_arena, block_size)
    start = nonneg_int(start, "start")
    n = _check_kv_pair(kv_arena, k, v)
    bits = np.dtype(f"u{kv_arena.dtype.itemsize}")
    arena_bits = kv_arena.view(bits)
    k_bits, v_bits = k.view(bits), v.view(bits)
    bad = []
    for b, bid, s0, s1, t0 in _block_runs(kv_arena, block_ids, block_size, start, n):
        t1 = t0 + (s1 - s0)
        if not (np.array_equal(arena_bits[bid, :, 0, s0:s1], k_bits[:, t0:t1])
                and np.array_equal(arena_bits[bid, :, 1, s0:s1], v_bits[:, t0:t1])):
            bad.append(b)
    return bad


# ----------------------------------------------------------------- attention


def _window_start(num_tokens: int, window) -> int:
    if window is None:
        return 0
    window = positive_int(window, "window")
    return max(0, num_tokens - window)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int | None = None) -> np.ndarray:
    """Reference decode attention over contiguous K/V (plain softmax, float64 math).

    Args:
        q: ``[L, H, D]`` query.
        k, v: ``[L, n, H, D]`` keys/values of positions 0..n-1.
        window: attend only the last ``window`` positions (None: all).

    Returns:
        float32 ``[L, H, D]``: ``softmax(q . K / sqrt(D)) V`` per layer and head.

    Raises:
        ValueError: shape mismatch, n == 0, or a non-positive window.
    """
    if k.ndim != 4 or k.shape != v.shape or q.shape != (k.shape[0],) + k.shape[2:]:
        raise ValueError(f"shapes do not fit: q {q.shape}, k {k.shape}, v {v.shape}")
    n = k.shape[1]
    if n == 0:
        raise ValueError("attention over zero tokens")
    lo = _window_start(n, window)
    kf = k[:, lo:].astype(np.float64)
    vf = v[:, lo:].astype(np.float64)
    qf = q.astype(np.float64)
    scores = np.einsum("lhd,lnhd->lhn", qf, kf) / math.sqrt(q.shape[-1])
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("lhn,lnhd->lhd", p, vf).astype(np.float32)


def paged_attention(q: np.ndarray, kv_arena: np.ndarray, block_ids, block_size: int,
                    num_tokens: int, window: int | None = None,
                    tile_blocks: int = 8) -> np.ndarray:
    """Decode attention read straight from the arena, with an online softmax.

    Blocks are visited in tiles of ``tile_blocks`` blocks (one gather each);
    a running max, running sum and running weighted V per (layer, head) merge
    the tiles flash-decoding style, so no full score vector over the sequence
    is materialised beyond one tile. Math is float32.

    Args:
        q: ``[L, H, D]`` query (any float dtype).
        kv_arena: the arena ``[num_blocks, L, 2, block_size, H, D]``.
        block_ids: the request's block table.
        block_size: tokens per block (must match the arena).
        num_tokens: attend positions 0..num_tokens-1 ...
        window: ... or only the last ``window`` of them (None: all).
            Table entries for blocks wholly before the window are never read
            and may be the null block 0.
        tile_blocks: blocks per tile (positive int).

    Returns:
        float32 ``[L, H, D]``.

    Raises:
        ValueError: shape mismatch, num_tokens < 1, a table too short, or a
            null/out-of-range block id inside the attended range.
    """
    _check_arena(kv_arena, block_size)
    num_tokens = positive_int(num_tokens, "num_tokens")
    tile_blocks = positive_int(tile_blocks, "tile_blocks")
    num_blocks, L, _, bs, H, D = kv_arena.shape
    if q.shape != (L, H, D):
        raise ValueError(f"q must be [L={L}, H={H}, D={D}], got {q.shape}")
    lo = _window_start(num_tokens, window)
    first, last = lo // bs, (num_tokens - 1) // bs
    if last >= len(block_ids):
        raise ValueError(
            f"block table has {len(block_ids)} entries, {num_tokens} tokens need {last + 1}"
        )
    ids = np.asarray(block_ids[first : last + 1], dtype=np.int64)
    if ids.size and ids.min() <= NULL_BLOCK:
        b = first + int(np.flatnonzero(ids <= NULL_BLOCK)[0])
        raise ValueError(
            f"block table entry {b} is the null block (or negative) inside the attended range"
        )
    if ids.size and ids.max() >= num_blocks:
        b = first + int(np.flatnonzero(ids >= num_blocks)[0])
        raise ValueError(f"block table entry {b}: block id out of range [1, {num_blocks})")

    qs = (q.astype(np.float32) * np.float32(1.0 / math.sqrt(D)))[:, :, None, :]  # [L,H,1,D]
    run_max = np.full((L, H, 1), -np.inf, dtype=np.float32)
    run_sum = np.zeros((L, H, 1), dtype=np.float32)
    acc = np.zeros((L, H, 1, D), dtype=np.float32)
    tb = min(tile_blocks, ids.size)
    buf = np.empty((2, L, tb, bs, H, D), dtype=np.float32)  # K and V of one tile
    for t0 in range(0, ids.size, tb):
        tile = ids[t0 : t0 + tb]
        nb = tile.size
        out = buf[:, :, :nb]
        widen_blocks(kv_arena, tile, out)  # K and V as float32 [2, L, nb, bs, H, D]
        # [L, H, T, D] views (row stride H*D, still fine for BLAS)
        kt = out[0].reshape(L, nb * bs, H, D).transpose(0, 2, 1, 3)
        vt = out[1].reshape(L, nb * bs, H, D).transpose(0, 2, 1, 3)
        # Mask slots outside [lo, num_tokens) in the tile's first/last blocks:
        # their K and V read as 0 (what an unwritten slot holds may be NaN or
        # inf, and a weight of 0 times that is not 0), their scores as -inf.
        p0 = (first + t0) * bs
        head, tail = lo - p0, p0 + nb * bs - num_tokens
        if head > 0:
            kt[:, :, :head] = vt[:, :, :head] = 0.0
        if tail > 0:
            kt[:, :, nb * bs - tail :] = vt[:, :, nb * bs - tail :] = 0.0
        scores = np.matmul(qs, kt.swapaxes(-1, -2))  # [L, H, 1, T]
        if head > 0:
            scores[..., :head] = -np.inf
        if tail > 0:
            scores[..., nb * bs - tail :] = -np.inf
        new_max = np.maximum(run_max, scores.max(axis=-1))  # finite: >= 1 valid slot
        alpha = np.exp(run_max - new_max)
        p = np.exp(scores - new_max[..., None])
        run_sum = run_sum * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + np.matmul(p, vt)
        run_max = new_max
    return (acc[:, :, 0] / run_sum).astype(np.float32)


# float16 bits -> float32 bits: sign-extend to int32 and shift the exponent and
# mantissa into place (sign lands in bits 28..31, keep only bit 31), then
# multiply by 2**(127 - 15) to rebias the exponent. Exact for every finite
# half, subnormals included; inf/NaN need the slow path.
_HALF_MASK = np.int32(0x8FFFE000 - (1 << 32))
_HALF_REBIAS = np.float32(2.0**112)
_HALF_EXP = np.uint16(0x7C00)


def widen_blocks(kv_arena: np.ndarray, tile: np.ndarray, out: np.ndarray) -> None:
    """Gather blocks ``tile`` of the arena and widen them exactly into float32
    ``out`` [2, L, nb, bs, H, D]. numpy's own half -> float cast is scalar and
    slow; the integer bit tricks below give identical values faster."""
    blk = kv_arena[tile]  # a fresh copy [nb, L, 2, bs, H, D]; ours to clobber
    src = blk.transpose(2, 1, 0, 3, 4, 5)
    dt = blk.dtype
    if dt == np.float16:
        bits = out.view(np.int32)
        np.copyto(bits, src.view(np.int16))  # sign-extends
        np.left_shift(bits, 13, out=bits)
        np.bitwise_and(bits, _HALF_MASK, out=bits)
        np.multiply(out, _HALF_REBIAS, out=out)
        u = blk.view(np.uint16)
        np.bitwise_and(u, _HALF_EXP, out=u)
        if u.max() != _HALF_EXP:
            return
        blk = kv_arena[tile]  # inf or NaN present: take numpy's exact cast
        src = blk.transpose(2, 1, 0, 3, 4, 5)
    elif dt.itemsize == 2 and dt.name == "bfloat16":
        bits = out.view(np.uint32)  # bfloat16 is the upper half of a float32
        np.copyto(bits, src.view(np.uint16))
        np.left_shift(bits, 16, out=bits)
        return
    np.copyto(out, src, casting="unsafe")
