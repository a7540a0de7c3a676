"""A tiny fixed-weight attention model whose K/V are bit-exact however they are computed.
CPU workers use it to fill the shared KV arena and to check blocks other processes wrote;
putting K/V into the arena's blocks and attending over them is workers/attention.py."""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import dataclass

import numpy as np

from kvshm.core.specs import KV_DTYPES
from kvshm.pool.arena import resolve_dtype

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

__all__ = [
    "Context",
    "TinyModel",
    "nonneg_int",
    "positive_int",
]

# Modular hash of the prefix: a Mersenne prime keeps products of two residues
# below 2**62 (exact in int64) and cumulative sums of residues far below 2**63.
_HASH_P = (1 << 31) - 1
_HASH_M = 48271
# The hash enters the hidden state as an integer in [-3, 3].
_MIX_MOD = 7
_WEIGHT_MAX = 4  # weights and embeddings are integers in [-4, 4]
_ROPE_BASE = 10000.0


def _supported_dtype(dtype) -> np.dtype:
    """A dtype name or dtype-like -> one of the supported arena dtypes."""
    if isinstance(dtype, str):
        return resolve_dtype(dtype)
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype: not a dtype: {dtype!r}") from e
    if dt.name not in KV_DTYPES:   # (ml_dtypes' bfloat16 is named "bfloat16")
        raise ValueError(
            f"dtype: unsupported KV dtype {dt}: expected {', '.join(KV_DTYPES)}"
        )
    return dt


def round_to_dtype(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
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


def positive_int(value, name: str) -> int:
    """``value`` as an int >= 1; raises ValueError naming ``name`` otherwise (bools too)."""
    return _int_at_least(value, name, 1)


def nonneg_int(value, name: str) -> int:
    """``value`` as an int >= 0; raises ValueError naming ``name`` otherwise (bools too)."""
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
        self.num_layers = positive_int(num_layers, "num_layers")
        self.num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
        self.head_size = positive_int(head_size, "head_size")
        if self.head_size % 2:
            raise ValueError(f"head_size must be even (rotary pairs), got {self.head_size}")
        self.d_model = positive_int(d_model, "d_model")
        self.vocab = positive_int(vocab, "vocab")
        self.max_positions = positive_int(max_positions, "max_positions")
        self.seed = nonneg_int(seed, "seed")
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
        start = nonneg_int(start, "start")
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
        dt = self.dtype
        return round_to_dtype(k, dt), round_to_dtype(v, dt), Context(start + n, state)

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
        pos = nonneg_int(pos, "pos")
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
