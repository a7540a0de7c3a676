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
        """`forward` for several requests at once, as an engine runs a step:
        the projections and the MLP see every segment's tokens in one matrix
        product (decode tokens batch well), attention runs per segment.
        `segments`: [(tokens, start, prefix_k, prefix_v)]; returns one
        (k, v, hidden) per segment."""
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
            x = x + _linear(attn, self.w_o[layer])
            gate, up = np.split(_linear(_rms(x), self.w_gate_up[layer]), 2, axis=1)
            x = x + _linear(gate / (1 + np.exp(-gate)) * up, self.w_down[layer])
        return [(ks[:, lo:hi], vs[:, lo:hi], x[lo:hi]) for lo, hi in spans]

    def decode(self, tokens, positions, view: np.ndarray, tables):
        """One new token per request, as an engine's decode step runs them:
        `tokens[i]` at position `positions[i]`, attending to itself and to the
        `positions[i]` earlier tokens, whose K/V are read from the request's
        blocks (`tables[i]`) of the arena `view` ([num_blocks, L, 2,
        block_size, H, D]) layer by layer, where a paged-attention kernel
        reads them, never gathered into a contiguous copy of the whole
        context first.  Every projection and the MLP see the whole batch in
        one matrix product.  Returns (k, v, hidden): k and v [L, B, H, D] in
        the model's dtype (the new tokens'), hidden [B, hidden] float32;
        equal to `forward` of each token within float32 rounding."""
        L, Hq, Hkv, D = self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_size
        g = Hq // Hkv
        bs = view.shape[3]
        if view.ndim != 6 or view.shape[1:3] != (L, 2) or view.shape[4:] != (Hkv, D):
            raise ValueError(f"the arena view must be [num_blocks, {L}, 2, block_size, {Hkv}, "
                             f"{D}], got {view.shape}")
        lengths = [nonneg_int(pos, "position") for pos in positions]
        B = len(lengths)
        if len(tokens) != B or len(tables) != B:
            raise ValueError(f"{len(tokens)} tokens, {B} positions and {len(tables)} block "
                             "tables: one of each per request")
        # Every request's blocks in one [B, max blocks] table, padded with
        # the null block; its positions past the request's length are masked.
        max_used = max((-(-n // bs) for n in lengths), default=0)
        ids = np.zeros((B, max_used), dtype=np.intp)
        for i, (n, table) in enumerate(zip(lengths, tables)):
            used = -(-n // bs)
            if len(table) < used:
                raise ValueError(f"request {i}: {len(table)} blocks hold fewer than its "
                                 f"{n} tokens")
            ids[i, :used] = table[:used]
        T = max_used * bs
        masked = (np.arange(T)[None, :] >= np.asarray(lengths)[:, None])[:, None, None, :]
        angles = np.asarray(lengths, dtype=np.float32)[:, None] * self.inv_freq
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        x = self.embed[np.asarray(tokens, dtype=np.int64) % self.vocab]
        ks = np.empty((L, B, Hkv, D), dtype=self.dtype)
        vs = np.empty_like(ks)
        out = np.empty((B, Hkv, g, D), dtype=np.float32)
        scale = np.float32(1 / np.sqrt(D))
        for layer in range(L):
            qkv = _linear(_rms(x), self.w_qkv[layer])
            q = _rotate(qkv[:, :Hq * D].reshape(B, Hq, D), cos, sin).reshape(B, Hkv, g, D)
            q *= scale
            ks[layer] = _rotate(qkv[:, Hq * D:(Hq + Hkv) * D].reshape(B, Hkv, D), cos, sin)
            vs[layer] = qkv[:, (Hq + Hkv) * D:].reshape(B, Hkv, D)
            k_new = ks[layer].astype(np.float32, copy=False)
            v_new = vs[layer].astype(np.float32, copy=False)
            own = np.einsum("bhgd,bhd->bhg", q, k_new)                  # [B, Hkv, g]
            # One gather (in C) of this layer's K of every request, one of
            # its V, then the whole batch in two matrix products.
            keys = view[ids, layer, 0].reshape(B, T, Hkv, D).transpose(0, 2, 3, 1)
            values = view[ids, layer, 1].reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)
            if keys.dtype != np.float32:
                keys, values = keys.astype(np.float32), values.astype(np.float32)
            scores = q @ keys                                            # [B, Hkv, g, T]
            np.putmask(scores, np.broadcast_to(masked, scores.shape), -np.inf)
            top = np.maximum(scores.max(axis=-1, initial=-np.inf), own)
            np.exp(scores - top[..., None], out=scores)
            w_own = np.exp(own - top)
            mixed = scores @ values                                      # [B, Hkv, g, D]
            mixed += w_own[..., None] * v_new[:, :, None, :]
            out[:] = mixed / (scores.sum(axis=-1) + w_own)[..., None]
            x = x + _linear(out.reshape(B, Hq * D), self.w_o[layer])
            gate, up = np.split(_linear(_rms(x), self.w_gate_up[layer]), 2, axis=1)
            x = x + _linear(gate / (1 + np.exp(-gate)) * up, self.w_down[layer])
        return ks, vs, x


def _linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [n, in] times a weight kept as [out, in]: `w @ x.T`, transposed back.

    NOTE: that layout and order, not `x @ w.T`, because decode batches of a
    few rows are memory-bound and the BLAS reads an [out, in] matrix once
    that way (about 2x faster at 4 rows here, the same at 512)."""
    return (w @ x.T).T


def _attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int) -> np.ndarray:
    """Causal grouped-query attention: q [n, Hq, D] (positions start..) over
    keys / values [T, Hkv, D] (T = start + n) -> [n, Hq * D]."""
    n, Hq, D = q.shape
    T, Hkv, _ = keys.shape
    g = Hq // Hkv
    qh = q.reshape(n, Hkv, g, D).transpose(1, 2, 0, 3)          # [Hkv, g, n, D]
    scores = qh @ keys.transpose(1, 2, 0)[:, None] / np.float32(np.sqrt(D))
    future = np.arange(T)[None, :] > (start + np.arange(n))[:, None]
    scores[..., future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ values.transpose(1, 0, 2)[:, None]            # [Hkv, g, n, D]
    return out.transpose(2, 0, 1, 3).reshape(n, Hq * D)


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


def _rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(_EPS))


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary positions on [n, heads, D] (pairs: first half, second half)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate((a * cos - b * sin, a * sin + b * cos), axis=-1)


class TransformerCompute(ComputeBase):
    """The transformer on the arena (one full-attention group): a step's
    prefill chunks run as one batch (over the K/V gathered from each
    request's blocks) and its decode tokens as another, which reads the
    context from the blocks layer by layer (`TransformerModel.decode`).

    Checks cost the same whether a request's prefix was a hit or not:
    `check_blocks` of each request's full prompt blocks, drawn from its id
    (the same blocks in a shared and an isolated run), are recomputed and
    compared within TOLERANCE, a hit block when the request is admitted, a
    block this worker computes once its K/V are written.  A recompute runs
    each stretch of adjacent sampled blocks over the arena's K/V of the
    tokens before it, so it costs a prefill of the sampled blocks (and
    their attention over the prefix), not of the whole prefix.
    `check_decode` is the fraction of decode tokens whose hidden state is
    compared with attention over the request's K/V read contiguously."""

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

    def run(self, seqs) -> None:
        st = self.stats
        decode = [s for s in seqs if s.scheduled == 1 and s.num_computed >= s.prompt_len]
        prefill = [s for s in seqs if not (s.scheduled == 1 and s.num_computed >= s.prompt_len)]
        if prefill:
            t0 = time.thread_time()
            outs = self.model.forward_batch([self._segment(seq) for seq in prefill])
            for seq, (k, v, _) in zip(prefill, outs):
                self.write(seq, seq.num_computed, k, v)
            st.kv_s += time.thread_time() - t0
            for seq in prefill:
                if seq.rid in self._pending:
                    self._check_computed(seq, seq.num_computed + seq.scheduled)
        if decode:
            t0 = time.thread_time()
            positions = [seq.num_computed for seq in decode]
            k, v, hidden = self.model.decode([seq.tokens[pos] for seq, pos in
                                              zip(decode, positions)],
                                             positions, self.view,
                                             [seq.tables[0] for seq in decode])
            for i, seq in enumerate(decode):
                self.write(seq, positions[i], k[:, i:i + 1], v[:, i:i + 1])
            st.attention_s += time.thread_time() - t0
            for i, seq in enumerate(decode):
                if self.rng.random() < self.opts.check_decode:
                    self._check_decode(seq, hidden[i])

    def _segment(self, seq):
        start = seq.num_computed
        if start:
            k, v = read_kv(self.view, seq.tables[0], self.block_size, 0, start)
        else:
            k = v = None
        return seq.tokens[start:start + seq.scheduled], start, k, v

    def started(self, seq) -> None:
        """A request admitted without hits: its sampled blocks are checked
        once computed."""
        self.admitted(seq, 0)

    def admitted(self, seq, num_hit: int) -> None:
        """Count the hits another worker wrote; on the request's first
        admission, draw its sampled blocks and check the hit ones now."""
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
                bad = self._mismatching(seq, hits)
                if bad:
                    self.bad_hits(seq, [table[i] for i in bad], f"differ from a recompute "
                                  f"by more than {TOLERANCE:g} of their scale")
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

    def _check_computed(self, seq, written: int) -> None:
        """Check the request's pending sampled blocks that the first
        `written` tokens' K/V now fill."""
        t0 = time.thread_time()
        st = self.stats
        bs = self.block_size
        pending = self._pending.pop(seq.rid)
        due = [i for i in pending if (i + 1) * bs <= written]
        if len(due) < len(pending):
            self._pending[seq.rid] = pending[len(due):]
        if due:
            st.computed_blocks_checked += len(due)
            bad = self._mismatching(seq, due)
            if bad:
                st.computed_mismatches += len(bad)
                self.error(f"{seq.rid}: {len(bad)} block(s) this worker computed differ "
                           f"from a recompute by more than {TOLERANCE:g} of their scale "
                           f"(block ids {[seq.tables[0][i] for i in bad][:8]})")
        st.check_s += time.thread_time() - t0

    def _mismatching(self, seq, idx: list[int]) -> list[int]:
        """Of the request's blocks `idx` (sorted), those whose K/V in the
        arena differ from a recompute.  Each stretch of adjacent blocks is
        recomputed in one pass over the arena's K/V of the tokens before it,
        so a wrong block is caught as itself, not as its successors."""
        bs = self.block_size
        table = seq.tables[0]
        bad = []
        for lo, hi in _stretches(idx):
            start = lo * bs
            if start:
                prefix_k, prefix_v = read_kv(self.view, table, bs, 0, start)
            else:
                prefix_k = prefix_v = None
            k, v, _ = self.model.forward(seq.tokens[start:hi * bs], start, prefix_k, prefix_v)
            bad += [lo + j for j in mismatching_blocks_within(self.view, table[lo:hi], bs, k, v)]
        return bad

    def _check_decode(self, seq, hidden: np.ndarray) -> None:
        """The decode step's hidden state against `forward` of the same token
        over the request's K/V gathered contiguously: the paged decode path
        against the plain one, over the same bytes (the bytes themselves are
        what the sampled blocks' recomputes check).  Costs a gather of the context and one
        token, where a recompute of the whole request would cost its prefill."""
        t0 = time.thread_time()
        st = self.stats
        pos = seq.num_computed
        k, v = read_kv(self.view, seq.tables[0], self.block_size, 0, pos)
        _, _, ref = self.model.forward(seq.tokens[pos:pos + 1], pos, k, v)
        st.decode_checks += 1
        scale = float(np.abs(ref[-1]).max()) or 1.0
        diff = float(np.abs(hidden - ref[-1]).max())
        if diff > TOLERANCE * scale:
            st.decode_mismatches += 1
            self.error(f"{seq.rid}: the decode step at position {pos} differs from "
                       f"attention over its contiguous K/V by {diff:.3g} (scale {scale:.3g})")
        st.check_s += time.thread_time() - t0
