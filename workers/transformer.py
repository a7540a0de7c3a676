"""A decoder layer stack with a real model's cost (`kvshm run --model transformer`).

Per layer: RMSNorm, Q/K/V projections, rotary positions, grouped-query
attention over the request's K/V (for earlier tokens: the paged blocks of
the arena, as read by the engine), output projection and a SwiGLU MLP, in
float32 numpy with fixed seeded weights.  The KV heads and head size come
from the pool's KV shape, the rest from a `DecoderShape` (a preset's, e.g.
`small`: Llama-3-8B's parameters per K/V value; by default twice as many
query heads as KV heads, a hidden size of query heads x head size and an
MLP of 3 x hidden).  Prefilling n tokens costs about 2 x parameters x n
FLOPs plus attention, as in a real model, so a prefix-cache hit saves what
it would in a real engine; `decoder_profile` gives those figures.

Not bit-exact: float32 BLAS results depend on how the tokens were chunked
(one prefill chunk or another), so K/V recomputed for a block agree with the
stored ones only within `TOLERANCE`, relative to the values' scale.  A
corrupted block is off by the values' whole magnitude and is caught.  The
exact model (model.py) stays for bit-exact integrity runs.
"""

from __future__ import annotations

import hashlib
import random
import time

import numpy as np

from kvshm.config import DecoderShape
from kvshm.workers.attention import read_kv
from kvshm.workers.compute import ComputeBase
from kvshm.workers.model import nonneg_int, positive_int

# Largest |cached - recomputed| accepted, in units of the recomputed block's
# largest |value|: float32 chunking differences are ~1e-6 of it, one step of
# float16 rounding 5e-4, of bfloat16 4e-3; a corrupted block is ~1 off.
TOLERANCE = 2e-2
_ROPE_BASE = 10000.0
_ATTENTION_TILE = 256   # query rows per pass of prefill attention
_EPS = 1e-5
# Llama-3-8B: 8.0B parameters (its embeddings included) over the 65,536 K/V
# values a token adds to its cache (32 layers x K and V x 8 KV heads x 128).
LLAMA3_8B_PARAMS_PER_KV = 8.0e9 / (32 * 2 * 8 * 128)


def decoder_dims(num_kv_heads: int, head_size: int, shape: DecoderShape | None
                 ) -> tuple[int, int, int]:
    """(query heads, hidden size, MLP intermediate size) of a decoder with
    this KV shape and `shape` (None: DecoderShape's defaults)."""
    shape = shape or DecoderShape()
    q_heads = num_kv_heads * positive_int(shape.query_per_kv, "query_per_kv")
    hidden = (q_heads * head_size if shape.hidden_size is None
              else positive_int(shape.hidden_size, "hidden_size"))
    inter = (3 * hidden if shape.intermediate_size is None
             else positive_int(shape.intermediate_size, "intermediate_size"))
    return q_heads, hidden, inter


def decoder_profile(kv, shape: DecoderShape | None, itemsize: int = 4) -> dict:
    """The cost profile of the transformer on KV shape `kv` (a KVShape) with
    `shape`: parameters (the embedding excluded), FLOPs per prefill token
    (2 x parameters, plus attention's per token of context), K/V values
    and bytes per token (`itemsize`: bytes of the arena's dtype), and
    parameters per K/V value against Llama-3-8B's."""
    L, Hkv, D = kv.num_layers, kv.num_kv_heads, kv.head_size
    Hq, d, inter = decoder_dims(Hkv, D, shape)
    params = L * (d * (Hq + 2 * Hkv) * D + Hq * D * d + 3 * d * inter)
    kv_values = L * 2 * Hkv * D
    per_kv = params / kv_values
    return {"layers": L, "query_heads": Hq, "kv_heads": Hkv, "head_size": D,
            "hidden_size": d, "intermediate_size": inter, "parameters": params,
            "prefill_flops_per_token": 2 * params,
            "attention_flops_per_context_token": 4 * L * Hq * D,
            "kv_values_per_token": kv_values, "kv_bytes_per_token": kv_values * itemsize,
            "parameters_per_kv_value": per_kv,
            "vs_llama3_8b": per_kv / LLAMA3_8B_PARAMS_PER_KV}


def format_profile(prof: dict) -> str:
    """`decoder_profile` in one line."""
    return (f"{prof['parameters'] / 1e6:,.1f}M parameters ({prof['layers']} layers, "
            f"hidden {prof['hidden_size']:,}, MLP {prof['intermediate_size']:,}, "
            f"{prof['query_heads']} query / {prof['kv_heads']} KV heads x "
            f"{prof['head_size']}); {prof['prefill_flops_per_token'] / 1e6:,.1f} MFLOP per "
            f"prefill token (+ {prof['attention_flops_per_context_token']:,} per token of "
            f"context); {prof['kv_bytes_per_token']:,} K/V bytes per token; "
            f"{prof['parameters_per_kv_value'] / 1e3:,.0f}k parameters per K/V value, "
            f"{prof['vs_llama3_8b']:.2f}x Llama-3-8B's {LLAMA3_8B_PARAMS_PER_KV / 1e3:,.0f}k")


class TransformerModel:
    """Fixed-weight decoder stack.  `forward(tokens, start, prefix_k,
    prefix_v)` runs new tokens at positions start.. over the K/V of the
    earlier ones and returns their K/V (in the arena's dtype, as a real
    engine stores them) and final hidden states."""

    exact = False

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_size: int, dtype,
                 seed: int = 0, vocab: int = 4096, shape: DecoderShape | None = None) -> None:
        self.num_layers = positive_int(num_layers, "num_layers")
        self.num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
        self.head_size = positive_int(head_size, "head_size")
        if self.head_size % 2:
            raise ValueError(f"head_size must be even (rotary pairs), got {self.head_size}")
        self.seed = nonneg_int(seed, "seed")
        self.vocab = positive_int(vocab, "vocab")
        self.dtype = np.dtype(dtype)
        L, Hkv, D = self.num_layers, self.num_kv_heads, self.head_size
        self.num_q_heads, d, inter = decoder_dims(Hkv, D, shape)
        self.hidden, self.intermediate = d, inter
        rng = np.random.default_rng(self.seed)

        def weights(*shape: int) -> np.ndarray:
            """[L, in, out] drawn, kept as [L, out, in] (see `_linear`)."""
            w = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-2]))
            w = np.ascontiguousarray(w.transpose(0, 2, 1))
            w.flags.writeable = False
            return w

        self.embed = rng.standard_normal((self.vocab, d), dtype=np.float32)
        self.w_qkv = weights(L, d, (self.num_q_heads + 2 * Hkv) * D)
        self.w_o = weights(L, self.num_q_heads * D, d)
        self.w_gate_up = weights(L, d, 2 * inter)
        self.w_down = weights(L, inter, d)
        self.inv_freq = (_ROPE_BASE ** (-np.arange(0, D, 2, dtype=np.float64) / D)
                         ).astype(np.float32)

    @property
    def parameters(self) -> int:
        """Weights a token's forward pass multiplies (the embedding excluded)."""
        return sum(w[0].size for w in (self.w_qkv, self.w_o, self.w_gate_up, self.w_down)
                   ) * self.num_layers

    def fingerprint(self) -> str:
        """Same weights, same fingerprint (every worker of a pool must agree)."""
        h = hashlib.sha256()
        for a in (self.embed, self.w_qkv, self.w_o, self.w_gate_up, self.w_down):
            h.update(a.tobytes())
        h.update(self.dtype.str.encode())
        return h.hexdigest()[:16]

    # -- the forward pass -----------------------------------------------------------------
    def forward(self, tokens, start: int, prefix_k: np.ndarray | None = None,
                prefix_v: np.ndarray | None = None):
        """Tokens at positions start..start+n-1, attending to themselves
        (causally) and to `prefix_k` / `prefix_v` ([L, start, H, D], the
        K/V of the earlier tokens; None when start is 0).  Returns
        (k, v, hidden): k and v [L, n, H, D] in the model's dtype, hidden
        [n, hidden] float32."""
        [(k, v, h)] = self.forward_batch([(tokens, start, prefix_k, prefix_v)])
        return k, v, h

    def forward_batch(self, segments):
        """`forward` for several requests at once (`step` without decode
        tokens): returns one (k, v, hidden) per segment."""
        return self.step(segments)[0]

    def decode(self, tokens, positions, view: np.ndarray, tables):
        """`step` with decode tokens only: returns their (k, v, hidden)."""
        return self.step([], (tokens, positions, view, tables))[1]

    def step(self, segments, decode=None):
        """One engine step: every segment's tokens and every decode token in
        one forward pass, as an engine with chunked prefill runs a step.  The
        projections and the MLP see all of them in one matrix product, so
        decode tokens riding with a prefill chunk cost little more than
        their attention (a decode-only step reads every weight for a few
        rows).

        `segments`: [(tokens, start, prefix_k, prefix_v)], tokens at
        positions start.. attending causally to themselves and to
        `prefix_k`/`prefix_v` ([L, start, H, D], the earlier tokens' K/V;
        None when start is 0).  `decode`: None, or (tokens, positions, view,
        tables): one new token per request, `tokens[i]` at `positions[i]`,
        attending to itself and to the `positions[i]` earlier tokens, whose
        K/V are read from the request's blocks (`tables[i]`) of the arena
        `view` ([num_blocks, L, 2, block_size, H, D]) layer by layer, where a
        paged-attention kernel reads them, never gathered into a contiguous
        copy of the whole context first.

        Returns (outs, dec): one (k, v, hidden) per segment (k and v [L, n,
        H, D] in the model's dtype, hidden [n, hidden] float32), and for the
        decode tokens (k, v, hidden) with k and v [L, B, H, D] (None without
        decode tokens); a decode token's are equal to `forward` of it within
        float32 rounding."""
        L, Hq, Hkv, D = self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_size
        toks, positions, spans = [], [], []
        at = 0
        for tokens, start, prefix_k, _ in segments:
            t = np.asarray(tokens, dtype=np.int64)
            if start and (prefix_k is None or prefix_k.shape[1] != start):
                raise ValueError(f"the K/V of the {start} earlier tokens are needed")
            toks.append(t)
            positions.append(np.arange(start, start + t.size, dtype=np.float32))
            spans.append((at, at + t.size))
            at += t.size
        paged = None
        if decode is not None:
            tokens, dec_positions, view, tables = decode
            paged = _PagedBatch(self, dec_positions, view, tables)
            if len(tokens) != paged.size:
                raise ValueError(f"{len(tokens)} tokens, {paged.size} positions and "
                                 f"{len(tables)} block tables: one of each per request")
            toks.append(np.asarray(tokens, dtype=np.int64))
            positions.append(np.asarray(paged.lengths, dtype=np.float32))
        if not toks:
            return [], None
        angles = np.concatenate(positions)[:, None] * self.inv_freq
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        x = self.embed[np.concatenate(toks) % self.vocab]
        n = x.shape[0]
        ks = np.empty((L, n, Hkv, D), dtype=self.dtype)
        vs = np.empty_like(ks)
        attn = np.empty((n, Hq * D), dtype=np.float32)
        for layer in range(L):
            qkv = _linear(_rms(x), self.w_qkv[layer])
            q = _rotate(qkv[:, :Hq * D].reshape(n, Hq, D), cos, sin)
            ks[layer] = _rotate(qkv[:, Hq * D:(Hq + Hkv) * D].reshape(n, Hkv, D), cos, sin)
            vs[layer] = qkv[:, (Hq + Hkv) * D:].reshape(n, Hkv, D)
            # Attention reads K/V as stored (rounded to the arena's dtype),
            # as an engine reading its cache does.
            for (lo, hi), (_, start, prefix_k, prefix_v) in zip(spans, segments):
                keys, values = ks[layer, lo:hi], vs[layer, lo:hi]
                if start:
                    keys = np.concatenate((prefix_k[layer], keys))
                    values = np.concatenate((prefix_v[layer], values))
                attn[lo:hi] = _attention(q[lo:hi], keys.astype(np.float32, copy=False),
                                         values.astype(np.float32, copy=False), start)
            if paged is not None:
                attn[at:] = paged.attention(layer, q[at:], ks[layer, at:], vs[layer, at:])
            x += _linear(attn, self.w_o[layer])
            x += _linear(_swiglu(_linear(_rms(x), self.w_gate_up[layer])), self.w_down[layer])
        outs = [(ks[:, lo:hi], vs[:, lo:hi], x[lo:hi]) for lo, hi in spans]
        return outs, (None if paged is None else (ks[:, at:], vs[:, at:], x[at:]))


class _PagedBatch:
    """The decode tokens of a step, attending over their requests' blocks in
    the arena: every request's blocks in one [B, max blocks] table, padded
    with the null block, positions past a request's length masked."""

    def __init__(self, model: TransformerModel, positions, view: np.ndarray, tables) -> None:
        L, Hkv, D = model.num_layers, model.num_kv_heads, model.head_size
        self.g = model.num_q_heads // Hkv
        self.Hkv, self.D = Hkv, D
        bs = view.shape[3]
        if view.ndim != 6 or view.shape[1:3] != (L, 2) or view.shape[4:] != (Hkv, D):
            raise ValueError(f"the arena view must be [num_blocks, {L}, 2, block_size, {Hkv}, "
                             f"{D}], got {view.shape}")
        self.lengths = [nonneg_int(pos, "position") for pos in positions]
        self.size = B = len(self.lengths)
        if len(tables) != B:
            raise ValueError(f"{B} positions and {len(tables)} block tables: one of each "
                             "per request")
        max_used = max((-(-n // bs) for n in self.lengths), default=0)
        self.ids = np.zeros((B, max_used), dtype=np.intp)
        for i, (n, table) in enumerate(zip(self.lengths, tables)):
            used = -(-n // bs)
            if len(table) < used:
                raise ValueError(f"request {i}: {len(table)} blocks hold fewer than its "
                                 f"{n} tokens")
            self.ids[i, :used] = table[:used]
        self.T = max_used * bs
        self.masked = (np.arange(self.T)[None, :] >= np.asarray(self.lengths)[:, None]
                       )[:, None, None, :]
        self.view = view
        self.scale = np.float32(1 / np.sqrt(D))

    def attention(self, layer: int, q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray
                  ) -> np.ndarray:
        """q [B, Hq, D], the new tokens' k and v [B, Hkv, D] (as stored):
        attention over each request's context and the token itself, [B, Hq x D]."""
        B, Hkv, g, D, T = self.size, self.Hkv, self.g, self.D, self.T
        q = q.reshape(B, Hkv, g, D) * self.scale
        k_new = k_new.astype(np.float32, copy=False)
        v_new = v_new.astype(np.float32, copy=False)
        own = np.einsum("bhgd,bhd->bhg", q, k_new)                      # [B, Hkv, g]
        # One gather (in C) of this layer's K of every request, one of its
        # V, then the whole batch in two matrix products.
        keys = self.view[self.ids, layer, 0].reshape(B, T, Hkv, D).transpose(0, 2, 3, 1)
        values = self.view[self.ids, layer, 1].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)
        if keys.dtype != np.float32:
            keys, values = keys.astype(np.float32), values.astype(np.float32)
        scores = q @ keys                                                # [B, Hkv, g, T]
        np.putmask(scores, np.broadcast_to(self.masked, scores.shape), -np.inf)
        top = np.maximum(scores.max(axis=-1, initial=-np.inf), own)
        np.exp(scores - top[..., None], out=scores)
        w_own = np.exp(own - top)
        mixed = scores @ values                                          # [B, Hkv, g, D]
        mixed += w_own[..., None] * v_new[:, :, None, :]
        return (mixed / (scores.sum(axis=-1) + w_own)[..., None]).reshape(B, Hkv * g * D)


def _linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [n, in] times a weight kept as [out, in]: `w @ x.T`, transposed back.

    NOTE: that layout and order, not `x @ w.T`, because decode batches of a
    few rows are memory-bound and the BLAS reads an [out, in] matrix once
    that way (about 2x faster at 4 rows here, the same at 512)."""
    return (w @ x.T).T


def _attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int,
               tile: int = _ATTENTION_TILE) -> np.ndarray:
    """Causal grouped-query attention: q [n, Hq, D] (positions start..) over
    keys / values [T, Hkv, D] (T = start + n) -> [n, Hq * D].

    Query rows go `tile` at a time, each tile over only the keys it can see
    (the prefix and the chunk up to its last row), so the scores stay small
    and the masked half of a long chunk is never computed."""
    n, Hq, D = q.shape
    T, Hkv, _ = keys.shape
    g = Hq // Hkv
    qh = (q * np.float32(1 / np.sqrt(D))).reshape(n, Hkv, g, D).transpose(1, 2, 0, 3)
    kt = np.ascontiguousarray(keys.transpose(1, 2, 0))[:, None]          # [Hkv, 1, D, T]
    vt = np.ascontiguousarray(values.transpose(1, 0, 2))[:, None]        # [Hkv, 1, T, D]
    out = np.empty((n, Hkv, g, D), dtype=np.float32)
    for r0 in range(0, n, tile):
        r1 = min(n, r0 + tile)
        end, lo = start + r1, start + r0          # keys the tile sees; its first row's position
        scores = qh[:, :, r0:r1] @ kt[..., :end]                          # [Hkv, g, rows, end]
        # Row r sees keys up to position lo + r: mask the rest of the diagonal tile.
        scores[..., lo:] += np.where(np.arange(end - lo)[None, :] > np.arange(r1 - r0)[:, None],
                                     np.float32(-np.inf), np.float32(0))
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        mixed = scores @ vt[:, :, :end]                                   # [Hkv, g, rows, D]
        mixed /= scores.sum(axis=-1, keepdims=True)
        out[r0:r1] = mixed.transpose(2, 0, 1, 3)
    return out.reshape(n, Hq * D)


def mismatching_blocks_within(view: np.ndarray, block_ids, block_size: int, k: np.ndarray,
                              v: np.ndarray, tolerance: float = TOLERANCE) -> list[int]:
    """Indices into `block_ids` whose K/V in the arena differ from `k` / `v`
    ([L, len(block_ids) * block_size, H, D], the recomputed values) by more
    than `tolerance` x the recomputed block's largest |value|."""
    bad = []
    for i, bid in enumerate(block_ids):
        got_k, got_v = read_kv(view, [bid], block_size, 0, block_size)
        for got, want in ((got_k, k), (got_v, v)):
            ref = want[:, i * block_size:(i + 1) * block_size].astype(np.float32)
            scale = float(np.abs(ref).max()) or 1.0
            if float(np.abs(got.astype(np.float32) - ref).max()) > tolerance * scale:
                bad.append(i)
                break
    return bad


def _stretches(idx: list[int]) -> list[tuple[int, int]]:
    """Sorted block indices as [lo, hi) stretches of adjacent ones."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _swiglu(gate_up: np.ndarray) -> np.ndarray:
    """silu(gate) * up of [n, 2 x inter] (gate, then up), in one buffer."""
    gate, up = np.split(gate_up, 2, axis=1)
    out = np.negative(gate)
    np.exp(out, out=out)
    out += 1
    np.divide(gate, out, out=out)
    out *= up
    return out


def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(_EPS))


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary positions on [n, heads, D] (pairs: first half, second half)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate((a * cos - b * sin, a * sin + b * cos), axis=-1)


class TransformerCompute(ComputeBase):
    """The transformer on the arena (one full-attention group).  A step runs
    as one forward pass (`TransformerModel.step`): its prefill chunks (over
    the K/V gathered from each request's blocks), its decode tokens (which
    read the context from the blocks layer by layer) and the recomputes its
    checks need, so the weights are read once per step, not once per kind.

    Checks cost the same whether a request's prefix was a hit or not:
    `check_blocks` of each request's full prompt blocks, drawn from its id
    (the same blocks in a shared and an isolated run), are recomputed and
    compared within TOLERANCE: a hit block in the step that admits the
    request, inside that step's forward pass; a block this worker computes
    once its K/V are written, in one batch with the step's other such
    blocks.  A recompute runs each stretch of adjacent sampled blocks over
    the arena's K/V of the tokens before it, so it costs a prefill of the
    sampled blocks (and their attention over the prefix), not of the whole
    prefix.  `check_decode` is the fraction of decode tokens whose hidden
    state is compared with attention over the request's K/V read
    contiguously, in the same forward pass.

    CPU time is split among prefill (`kv_s`), decode (`attention_s`) and
    checks (`check_s`) by the rows each has in a pass: the marginal cost of
    a row, within the attention's share (a decode-only step is all decode)."""

    def __init__(self, config, arena, opts, stats, tag: int) -> None:
        super().__init__(config, arena, opts, stats, tag)
        kv = config.kv
        self.model = TransformerModel(num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads,
                                      head_size=kv.head_size, dtype=arena.dtype,
                                      seed=opts.seed, shape=opts.decoder)
        self.view = self.views[0]
        self.block_size = self.groups[0][1]
        self._sampled: set[str] = set()           # requests whose blocks were drawn
        self._pending: dict[str, list[int]] = {}  # rid -> sampled blocks to compute
        self._hit_checks: list[tuple] = []        # (seq, stretch) of hits admitted this step

    def run(self, seqs) -> None:
        st = self.stats
        decode = [s for s in seqs if s.scheduled == 1 and s.num_computed >= s.prompt_len]
        prefill = [s for s in seqs if not (s.scheduled == 1 and s.num_computed >= s.prompt_len)]
        hit_checks, self._hit_checks = self._hit_checks, []
        decode_checks = [i for i in range(len(decode))
                         if self.rng.random() < self.opts.check_decode]
        t0 = time.thread_time()
        segments = [self._segment(seq, seq.num_computed, seq.scheduled) for seq in prefill]
        segments += [self._segment(seq, lo * self.block_size, (hi - lo) * self.block_size)
                     for seq, (lo, hi) in hit_checks]
        segments += [self._segment(decode[i], decode[i].num_computed, 1) for i in decode_checks]
        dec = None
        if decode:
            positions = [seq.num_computed for seq in decode]
            dec = ([seq.tokens[pos] for seq, pos in zip(decode, positions)], positions,
                   self.view, [seq.tables[0] for seq in decode])
        outs, dec_out = self.model.step(segments, dec)
        for seq, (k, v, _) in zip(prefill, outs):
            self.write(seq, seq.num_computed, k, v)
        if dec_out is not None:
            k, v, hidden = dec_out
            for i, seq in enumerate(decode):
                self.write(seq, seq.num_computed, k[:, i:i + 1], v[:, i:i + 1])
        rows_p = sum(seq.scheduled for seq in prefill)
        rows_c = sum(len(t) for t, *_ in segments[len(prefill):])
        spent = time.thread_time() - t0
        t0 = time.thread_time()
        rows = max(rows_p + rows_c + len(decode), 1)
        st.kv_s += spent * rows_p / rows
        st.attention_s += spent * len(decode) / rows
        st.check_s += spent * rows_c / rows
        checked = outs[len(prefill):]
        for (seq, (lo, hi)), (k, v, _) in zip(hit_checks, checked):
            table = seq.tables[0]
            bad = mismatching_blocks_within(self.view, table[lo:hi], self.block_size, k, v)
            if bad:
                self.bad_hits(seq, [table[lo + j] for j in bad], "hit in the prefix cache "
                              f"differ from a recompute "
                              f"by more than {TOLERANCE:g} of their scale")
        for i, (_, _, ref) in zip(decode_checks, checked[len(hit_checks):]):
            self._check_decode(decode[i], hidden[i], ref[-1])
        st.check_s += time.thread_time() - t0
        self._check_computed([seq for seq in prefill if seq.rid in self._pending])

    def _segment(self, seq, start: int, n: int):
        """A request's tokens start..start+n over the arena's K/V of the
        tokens before them."""
        if start:
            k, v = read_kv(self.view, seq.tables[0], self.block_size, 0, start)
        else:
            k = v = None
        return seq.tokens[start:start + n], start, k, v

    def started(self, seq) -> None:
        """A request admitted without hits: its sampled blocks are checked
        once computed."""
        self.admitted(seq, 0)

    def admitted(self, seq, num_hit: int) -> None:
        """Count the hits another worker wrote; on the request's first
        admission, draw its sampled blocks; the hit ones are checked in this
        step's forward pass."""
        t0 = time.thread_time()
        st = self.stats
        bs = self.block_size
        table = seq.tables[0]
        writer = self.arena.writer
        st.cross_hit_tokens += bs * sum(1 for i in range(num_hit // bs)
                                        if writer[table[i]] != self.tag)
        if seq.rid not in self._sampled:
            self._sampled.add(seq.rid)
            sample = self.sampled_blocks(seq.rid, seq.prompt_len // bs)
            hits = [i for i in sample if i < num_hit // bs]
            if hits:
                st.hit_blocks_checked += len(hits)
                self._hit_checks += [(seq, s) for s in _stretches(hits)]
            rest = sample[len(hits):]
            if rest:
                self._pending[seq.rid] = rest
        st.check_s += time.thread_time() - t0

    def sampled_blocks(self, rid: str, num_full: int) -> list[int]:
        """The `check_blocks` of a request's `num_full` full prompt blocks
        to check (sorted indices), drawn from its id and `sample_seed`."""
        n = min(self.opts.check_blocks, num_full)
        if n <= 0:
            return []
        rng = random.Random(f"{self.opts.sample_seed}:{rid}")
        return sorted(rng.sample(range(num_full), n))

    def _check_computed(self, seqs) -> None:
        """Check the requests' pending sampled blocks that their K/V written
        so far (this step's included) fill, all in one forward pass."""
        if not seqs:
            return
        t0 = time.thread_time()
        st = self.stats
        bs = self.block_size
        due = []
        for seq in seqs:
            pending = self._pending.pop(seq.rid)
            written = seq.num_computed + seq.scheduled
            ready = [i for i in pending if (i + 1) * bs <= written]
            if len(ready) < len(pending):
                self._pending[seq.rid] = pending[len(ready):]
            st.computed_blocks_checked += len(ready)
            due += [(seq, s) for s in _stretches(ready)]
        if due:
            outs = self.model.forward_batch([self._segment(seq, lo * bs, (hi - lo) * bs)
                                             for seq, (lo, hi) in due])
            bad: dict[str, list[int]] = {}
            for (seq, (lo, hi)), (k, v, _) in zip(due, outs):
                table = seq.tables[0]
                for j in mismatching_blocks_within(self.view, table[lo:hi], bs, k, v):
                    bad.setdefault(seq.rid, []).append(table[lo + j])
            for rid, ids in bad.items():
                st.computed_mismatches += len(ids)
                self.error(f"{rid}: {len(ids)} block(s) this worker computed differ from a "
                           f"recompute by more than {TOLERANCE:g} of their scale (block ids "
                           f"{ids[:8]})")
        st.check_s += time.thread_time() - t0

    def _check_decode(self, seq, hidden: np.ndarray, ref: np.ndarray) -> None:
        """The decode step's hidden state against `forward` of the same token
        over the request's K/V gathered contiguously: the paged decode path
        against the plain one, over the same bytes (the bytes themselves are
        what the sampled blocks' recomputes check).  Costs a gather of the
        context and one row of the step's pass, where a recompute of the
        whole request would cost its prefill."""
        st = self.stats
        st.decode_checks += 1
        scale = float(np.abs(ref).max()) or 1.0
        diff = float(np.abs(hidden - ref).max())
        if diff > TOLERANCE * scale:
            st.decode_mismatches += 1
            self.error(f"{seq.rid}: the decode step at position {seq.num_computed} differs "
                       f"from attention over its contiguous K/V by {diff:.3g} (scale "
                       f"{scale:.3g})")
