"""A tiny fixed-weight attention model whose K/V are bit-exact however they are computed.
CPU workers use it to fill the shared KV arena and to check blocks other processes wrote."""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import dataclass

import numpy as np

try:
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    _ml_dtypes = None

# Why the K/V of a token are the same bits whatever chunking, process or BLAS
# threading computed them:
#
# * every value that reaches a matrix product is an integer stored as float64
#   (embedding rows, projection weights, the causal mixing term), and all partial
#   sums stay far below 2**53, so any summation order gives the exact result;
# * the causal context is a polynomial hash of the prefix computed in int64
#   modular arithmetic (exact); its state after ``n`` tokens is a small
#   :class:`Context`, so a sequence can be continued from any position;
# * positions enter through rotary tables computed once per model in a single
#   ``np.cos``/``np.sin`` call over all positions; applying them is elementwise
#   float64 arithmetic (deterministic), followed by a power-of-two scale (exact)
#   and one correctly rounded cast to the arena dtype. (np.cos/np.sin may
#   differ in the last bit between CPUs with different SIMD support; processes
#   on one host agree, and TinyModel.fingerprint() tells whether two do.)
#
# Arena layout: ``kv[block, layer, 0 (K) | 1 (V), slot, kv_head, dim]``. Token
# ``pos`` of a request lives in ``block_ids[pos // block_size]`` at slot
# ``pos % block_size``. Block 0 is the null block: never written or read, and a
# block-table entry 0 marks a block dropped by sliding-window attention.

__all__ = [
    "Context",
    "TinyModel",
    "attention",
    "mismatching_blocks",
    "paged_attention",
    "read_kv",
    "resolve_dtype",
    "write_kv",
]

NULL_BLOCK = 0

# Modular hash of the prefix: a Mersenne prime keeps products of two residues
# below 2**62 (exact in int64) and cumulative sums of residues far below 2**63.
_HASH_P = (1 << 31) - 1
_HASH_M = 48271
# The hash enters the hidden state as an integer in [-3, 3].
_MIX_MOD = 7
_WEIGHT_MAX = 4  # weights and embeddings are integers in [-4, 4]
_ROPE_BASE = 10000.0


def resolve_dtype(name: str) -> np.dtype:
    """Map a dtype name to the numpy dtype used for the KV arena.

    Args:
        name: ``"float32"``, ``"float16"`` or ``"bfloat16"``.

    Returns:
        The numpy dtype (``ml_dtypes.bfloat16`` for ``"bfloat16"``).

    Raises:
        ValueError: unknown name, or ``"bfloat16"`` without ml_dtypes installed.
    """
    if name == "float32":
        return np.dtype(np.float32)
    if name == "float16":
        return np.dtype(np.float16)
    if name == "bfloat16":
        if _ml_dtypes is None:
            raise ValueError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
        return np.dtype(_ml_dtypes.bfloat16)
    raise ValueError(
        f"unknown KV dtype {name!r}: expected 'float32', 'float16' or 'bfloat16'"
    )


def _supported_dtype(dtype) -> np.dtype:
    """A dtype name or dtype-like -> one of the supported arena dtypes."""
    if isinstance(dtype, str):
        return resolve_dtype(dtype)
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype: not a dtype: {dtype!r}") from e
    supported = [np.dtype(np.float32), np.dtype(np.float16)]
    if _ml_dtypes is not None:
        supported.append(np.dtype(_ml_dtypes.bfloat16))
    if dt not in supported:
        raise ValueError(
            f"dtype: unsupported KV dtype {dt}: expected float32, float16 or bfloat16"
        )
    return dt


def _cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round float64 ``x`` to ``dtype`` once, to nearest-even.

    numpy casts float64 to float32/float16 correctly rounded. ml_dtypes casts
    float64 to bfloat16 through float32 (two roundings, which can differ from
    one at ties); to keep a single rounding we first round to float32 *to odd*
    (exact for the following float32 -> bfloat16 round-to-nearest-even, since
    float32 has more than 8 + 2 significand bits).
    """
    if dtype == np.float32 or dtype == np.float16:
        return x.astype(dtype)
    f = x.astype(np.float32)
    back = f.astype(np.float64)
    inexact = back != x
    above = np.abs(back) > np.abs(x)  # rounded away from zero: step back one ulp
    bits = f.view(np.uint32)
    bits -= (inexact & above).astype(np.uint32)
    bits |= inexact.astype(np.uint32)
    return f.astype(dtype)


def _int_at_least(value, name: str, minimum: int) -> int:
    what = "a positive" if minimum == 1 else "a non-negative"
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {what} int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be {what} int, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be {what} int, got {v}")
    return v


def _positive_int(value, name: str) -> int:
    return _int_at_least(value, name, 1)


def _nonneg_int(value, name: str) -> int:
    return _int_at_least(value, name, 0)


def _token_array(tokens) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be ints, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _mod_powers(base: int, n: int) -> np.ndarray:
    """``base**i mod P`` for i in [0, n), as int64, without a loop per element."""
    width = max(1, math.isqrt(n) + 1)
    low = np.empty(width, dtype=np.int64)
    acc = 1
    for i in range(width):
        low[i] = acc
        acc = acc * base % _HASH_P
    step = acc  # base**width
    rows = -(-n // width)
    high = np.empty(rows, dtype=np.int64)
    acc = 1
    for i in range(rows):
        high[i] = acc
        acc = acc * step % _HASH_P
    return ((high[:, None] * low[None, :]) % _HASH_P).reshape(-1)[:n]


@dataclass(frozen=True, eq=False)
class Context:
    """State of a sequence after its first ``length`` tokens.

    Attributes:
        length: number of tokens consumed (= position of the next token).
        state: int64 [d_model], the prefix hash ``sum_j E[tok_j] * M**-j mod P``
            (read-only). Equal prefixes give equal contexts, in any process.
            A context is only meaningful to models with the same seed and d_model.
    """

    length: int
    state: np.ndarray

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Context):
            return NotImplemented
        return self.length == other.length and np.array_equal(self.state, other.state)

    __hash__ = None  # mutable-looking array inside; not hashable


class TinyModel:
    """Fixed-weight toy attention model producing bit-exact K/V and queries.

    Hidden state of token i (integers, exact in float64)::

        c(i) = M**i * sum_{j<=i} E[tok_j] * M**-j   (mod P, elementwise)
        h(i) = E[tok_i % vocab] + (c(i) mod 7) - 3

    Per layer l: ``K = rope(h @ Wk[l]) * scale``, ``V = (h @ Wv[l]) * scale``,
    ``Q = rope(h @ Wq[l]) * scale``; K and V are cast once to ``dtype``, Q is
    returned as float32. ``scale`` is a power of two chosen from ``d_model`` so
    that values are mostly within |x| < 8.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        dtype,
        seed: int = 0,
        d_model: int = 64,
        vocab: int = 4096,
        max_positions: int = 131072,
    ) -> None:
        """Draw the weights and precompute the rotary and hash tables.

        Args:
            num_layers, num_kv_heads, head_size: arena geometry (positive ints;
                head_size must be even for rotary).
            dtype: K/V dtype, a name for :func:`resolve_dtype` or a numpy dtype
                (float32, float16 or bfloat16).
            seed: non-negative int for ``np.random.default_rng``; same seed,
                same model, in every process.
            d_model: hidden size (positive int).
            vocab: embedding rows; token t uses row ``t % vocab``.
            max_positions: positions supported (tables cover 0..max_positions-1).
                Memory is about ``max_positions * head_size * 8`` bytes.

        Raises:
            ValueError: a non-positive or non-int argument (named in the
                message), an odd head_size or an unsupported dtype.
        """
        self.num_layers = _positive_int(num_layers, "num_layers")
        self.num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
        self.head_size = _positive_int(head_size, "head_size")
        if self.head_size % 2:
            raise ValueError(f"head_size must be even (rotary pairs), got {self.head_size}")
        self.d_model = _positive_int(d_model, "d_model")
        self.vocab = _positive_int(vocab, "vocab")
        self.max_positions = _positive_int(max_positions, "max_positions")
        self.seed = _nonneg_int(seed, "seed")
        self.dtype = _supported_dtype(dtype)

        L, H, D, d = self.num_layers, self.num_kv_heads, self.head_size, self.d_model
        # |h| <= 4 + 3 and |W| <= 4: every partial sum of h @ W is an integer of
        # magnitude <= 28 * d_model, exact in float64 in any order.
        rng = np.random.default_rng(self.seed)
        w = _WEIGHT_MAX
        self.embed = rng.integers(-w, w + 1, size=(self.vocab, d)).astype(np.float64)
        self.wk = rng.integers(-w, w + 1, size=(L, d, H * D)).astype(np.float64)
        self.wv = rng.integers(-w, w + 1, size=(L, d, H * D)).astype(np.float64)
        self.wq = rng.integers(-w, w + 1, size=(L, d, H * D)).astype(np.float64)
        for a in (self.embed, self.wk, self.wv, self.wq):
            a.flags.writeable = False
        # Residues of the embedding rows for the prefix hash.
        self._embed_mod = (self.embed.astype(np.int64) % _HASH_P)
        self._pow = _mod_powers(_HASH_M, self.max_positions)
        self._ipow = _mod_powers(pow(_HASH_M, -1, _HASH_P), self.max_positions)

        # Rotary tables: one np.cos / np.sin call over every position.
        inv_freq = _ROPE_BASE ** (-np.arange(0, D, 2, dtype=np.float64) / D)
        angles = np.arange(self.max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
        self._cos = np.cos(angles)
        self._sin = np.sin(angles)

        # Std of h @ W is about sqrt(d * var(h) * var(W)) ~ 8.4 * sqrt(d); scale
        # it to ~2 with a power of two (multiplying by it is exact).
        std = math.sqrt(d * (20.0 / 3.0 + 4.0) * (20.0 / 3.0))
        self.scale = 2.0 ** -round(math.log2(std / 2.0))
        self._fingerprint: str | None = None

    # ------------------------------------------------------------------ state

    def _empty_state(self) -> np.ndarray:
        return np.zeros(self.d_model, dtype=np.int64)

    def _check_ctx(self, ctx: Context, start: int, name: str = "start") -> None:
        if not isinstance(ctx, Context):
            raise ValueError(f"ctx must be a Context, got {type(ctx).__name__}")
        if ctx.state.shape != (self.d_model,):
            raise ValueError(f"ctx: state shape {ctx.state.shape} does not fit d_model={self.d_model}")
        if ctx.length != start:
            raise ValueError(f"ctx is the state after {ctx.length} tokens, but {name}={start}")

    def _scan(self, toks: np.ndarray, start: int, state: np.ndarray):
        """Hash states for positions start..start+n-1 -> (c [n, d] int64, new state)."""
        n = toks.size
        if start + n > self.max_positions:
            raise ValueError(
                f"positions {start}..{start + n - 1} exceed max_positions={self.max_positions}"
            )
        e = self._embed_mod[toks % self.vocab]  # [n, d], residues < P
        terms = e * self._ipow[start : start + n, None] % _HASH_P  # < P**2 < 2**62
        sums = (np.cumsum(terms, axis=0) + state[None, :]) % _HASH_P  # n * P << 2**63
        c = sums * self._pow[start : start + n, None] % _HASH_P
        new_state = sums[-1].copy() if n else state.copy()
        new_state.flags.writeable = False
        return c, new_state

    def _hidden(self, toks: np.ndarray, start: int, state: np.ndarray):
        c, new_state = self._scan(toks, start, state)
        h = self.embed[toks % self.vocab] + (c % _MIX_MOD - _MIX_MOD // 2).astype(np.float64)
        return h, new_state

    def context(self, tokens) -> Context:
        """State after ``tokens`` (positions 0..len-1), e.g. after prefix-cache hits.

        Args:
            tokens: 1-D sequence of ints.

        Returns:
            The :class:`Context` to pass to :meth:`kv` / :meth:`query` with
            ``start = len(tokens)``.

        Raises:
            ValueError: tokens not a 1-D int sequence, or longer than max_positions.
        """
        toks = _token_array(tokens)
        _, state = self._scan(toks, 0, self._empty_state())
        return Context(length=int(toks.size), state=state)

    # -------------------------------------------------------------- compute

    def _rope(self, x: np.ndarray, start: int) -> np.ndarray:
        """Rotate float64 x [L, n, H, D] for positions start..start+n-1 (elementwise)."""
        n = x.shape[1]
        half = self.head_size // 2
        cos = self._cos[start : start + n][None, :, None, :]
        sin = self._sin[start : start + n][None, :, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        out = np.empty_like(x)
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:] = x2 * cos + x1 * sin
        return out

    def kv(self, tokens, start: int, ctx: Context) -> tuple[np.ndarray, np.ndarray, Context]:
        """K and V of ``tokens`` at positions ``start, start+1, ...``.

        Args:
            tokens: 1-D sequence of ints (may be empty).
            start: position of ``tokens[0]``.
            ctx: state after the first ``start`` tokens (``ctx.length == start``):
                ``model.context(prefix)`` or the context returned by a previous
                call.

        Returns:
            ``(k, v, ctx_after)``: k and v are ``[num_layers, n, num_kv_heads,
            head_size]`` in the model dtype; ctx_after is the state after these
            tokens. The bits of token i's K/V depend only on the model and the
            tokens 0..i, not on how the sequence was split into calls.

        Raises:
            ValueError: bad tokens, ``ctx.length != start``, or positions beyond
                max_positions.
        """
        start = _nonneg_int(start, "start")
        self._check_ctx(ctx, start)
        toks = _token_array(tokens)
        n = toks.size
        L, H, D = self.num_layers, self.num_kv_heads, self.head_size
        h, state = self._hidden(toks, start, ctx.state)
        k = np.matmul(h[None], self.wk).reshape(L, n, H, D)  # exact: integer sums
        v = np.matmul(h[None], self.wv).reshape(L, n, H, D)
        k = self._rope(k, start)
        k *= self.scale
        v *= self.scale
        return _cast(k, self.dtype), _cast(v, self.dtype), Context(start + n, state)

    def query(self, token: int, pos: int, ctx: Context) -> np.ndarray:
        """Query vector of ``token`` at position ``pos``, for decode attention.

        Args:
            token: the token id.
            pos: its position.
            ctx: the state after the tokens BEFORE it (``ctx.length == pos``),
                i.e. the same context :meth:`kv` takes for this token.

        Returns:
            float32 ``[num_layers, num_kv_heads, head_size]``.

        Raises:
            ValueError: ``ctx.length != pos`` or pos beyond max_positions.
        """
        pos = _nonneg_int(pos, "pos")
        self._check_ctx(ctx, pos, "pos")
        toks = _token_array([operator.index(token)])
        L, H, D = self.num_layers, self.num_kv_heads, self.head_size
        h, _ = self._hidden(toks, pos, ctx.state)
        q = np.matmul(h[None], self.wq).reshape(L, 1, H, D)
        q = self._rope(q, pos) * self.scale
        return q[:, 0].astype(np.float32)

    def fingerprint(self) -> str:
        """Hex digest of everything that determines K/V (weights, tables, dtype).

        Two processes whose models have the same fingerprint produce the same
        K/V bits; workers can compare it before trusting each other's blocks.
        """
        if self._fingerprint is None:
            hsh = hashlib.blake2b(digest_size=16)
            hsh.update(str(self.dtype).encode())
            hsh.update(np.float64(self.scale).tobytes())
            for a in (self.embed, self.wk, self.wv, self.wq, self._cos, self._sin):
                hsh.update(np.ascontiguousarray(a).tobytes())
            self._fingerprint = hsh.hexdigest()
        return self._fingerprint


# ----------------------------------------------------------------- arena I/O


def _check_arena(kv_arena: np.ndarray, block_size: int) -> None:
    if not isinstance(kv_arena, np.ndarray) or kv_arena.ndim != 6 or kv_arena.shape[2] != 2:
        shape = getattr(kv_arena, "shape", None)
        raise ValueError(
            "kv_arena must be an array [num_blocks, num_layers, 2, block_size, "
            f"num_kv_heads, head_size], got shape {shape}"
        )
    bs = _positive_int(block_size, "block_size")
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
        k, v: ``[L, n, H, D]`` in the arena's dtype (as :meth:`TinyModel.kv`).

    Raises:
        ValueError: shape/dtype mismatch, a table too short, or a null or
            out-of-range block id where a token must be written.
    """
    _check_arena(kv_arena, block_size)
    start = _nonneg_int(start, "start")
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
    start = _nonneg_int(start, "start")
    n = _nonneg_int(n, "n")
    _, L, _, _, H, D = kv_arena.shape
    k = np.empty((L, n, H, D), dtype=kv_arena.dtype)
    v = np.empty_like(k)
    for _, bid, s0, s1, t0 in _block_runs(kv_arena, block_ids, block_size, start, n):
        t1 = t0 + (s1 - s0)
        k[:, t0:t1] = kv_arena[bid, :, 0, s0:s1]
        v[:, t0:t1] = kv_arena[bid, :, 1, s0:s1]
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
    start = _nonneg_int(start, "start")
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
    window = _positive_int(window, "window")
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
    num_tokens = _positive_int(num_tokens, "num_tokens")
    tile_blocks = _positive_int(tile_blocks, "tile_blocks")
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
        _widen(kv_arena, tile, out)  # K and V as float32 [2, L, nb, bs, H, D]
        # [L, H, T, D] views (row stride H*D, still fine for BLAS)
        kt = out[0].reshape(L, nb * bs, H, D).transpose(0, 2, 1, 3)
        vt = out[1].reshape(L, nb * bs, H, D).transpose(0, 2, 1, 3)
        scores = np.matmul(qs, kt.swapaxes(-1, -2))  # [L, H, 1, T]
        # Mask slots outside [lo, num_tokens) in the tile's first/last blocks.
        p0 = (first + t0) * bs
        head, tail = lo - p0, p0 + nb * bs - num_tokens
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


def _widen(kv_arena: np.ndarray, tile: np.ndarray, out: np.ndarray) -> None:
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
