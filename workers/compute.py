"""What a CPU worker computes on the arena for its scheduled tokens: the
model's K/V written into the request's blocks, the decode attention, and the
checks of prefix-cache hits, behind one interface the engine's scheduler
calls (`run(seqs)`, `admitted(seq, num_hit)`).

`ExactCompute` runs the bit-exact model (model.py): every hit block is
compared bit for bit with a recompute, decode attention over the paged
blocks with attention over a contiguous recompute.  `TransformerCompute`
(transformer.py) runs a real decoder stack, checked within a tolerance.
The engine picks one by name (`make_compute` in engine.py, from
EngineOptions.model).
"""

from __future__ import annotations

import random
import time

import numpy as np

from kvshm.core.specs import PoolConfig
from kvshm.workers.attention import attention, mismatching_blocks, paged_attention, write_kv
from kvshm.workers.model import TinyModel

MODELS = ("exact", "transformer")


class ComputeBase:
    """What both models share: the pool's groups and arena views, this
    worker's writer tag, the stats and the sampling rng."""

    def __init__(self, config: PoolConfig, arena, opts, stats, tag: int) -> None:
        self.config = config
        self.arena = arena
        self.opts = opts
        self.stats = stats
        self.tag = tag                        # written into arena.writer for our blocks
        self.num_layers = config.kv.num_layers
        self.groups = [(g, spec.block_size, getattr(spec, "sliding_window", None))
                       for g, spec in enumerate(config.groups)]
        # Per group: the arena seen with the group's block size on the slot axis.
        self.views = [arena.kv[:, :, :, :bs] for _, bs, _ in self.groups]
        self.rng = random.Random(opts.sample_seed)
        self.found: dict = {}   # request -> its blocks found wrong (take_found)

    def write(self, seq, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """K/V [groups x L, n, H, D] of tokens start.. into the request's blocks."""
        L = self.num_layers
        writer = self.arena.writer
        n = k.shape[1]
        for (g, bs, _), view in zip(self.groups, self.views):
            table = seq.tables[g]
            write_kv(view, table, bs, start, k[g * L:(g + 1) * L], v[g * L:(g + 1) * L])
            writer[table[start // bs:-(-(start + n) // bs)]] = self.tag

    def hit_blocks(self, seq, num_hit: int) -> list[tuple[int, int, list[int]]]:
        """The hit blocks to check, per group [(group, block size, indices)]
        (all, or a `verify_hits` sample); counts the hit tokens in blocks
        another worker wrote."""
        st = self.stats
        writer = self.arena.writer
        frac = self.opts.verify_hits
        checks = []
        for g, bs, _ in self.groups:
            table = seq.tables[g]
            idx = [i for i in range(num_hit // bs) if table[i] != 0]   # 0: outside a window
            if g == 0:
                st.cross_hit_tokens += bs * sum(1 for i in idx if writer[table[i]] != self.tag)
            if frac < 1.0:
                idx = [i for i in idx if self.rng.random() < frac]
            if idx:
                checks.append((g, bs, idx))
        return checks

    def error(self, message: str) -> None:
        if not self.stats.first_error:
            self.stats.first_error = message

    def bad_hits(self, seq, block_ids: list[int], how: str) -> None:
        """Blocks `seq` read whose K/V are wrong (hits, or its own blocks a
        decode check caught): kept for the engine to heal (`take_found`),
        counted, and the first case described."""
        st = self.stats
        self.found.setdefault(seq, []).extend(block_ids)
        st.corrupt_findings += len(block_ids)
        if not st.first_corruption:
            st.first_corruption = (f"{seq.rid}: {len(block_ids)} block(s) {how} (block ids "
                                   f"{block_ids[:8]})")

    def take_found(self) -> dict:
        """The requests whose blocks were found wrong since the last call ->
        those blocks."""
        found, self.found = self.found, {}
        return found

    def fingerprint(self) -> str:
        """The model's fingerprint (every worker of a pool must agree)."""
        return self.model.fingerprint()


class ExactCompute(ComputeBase):
    """The bit-exact model: one layer stack per group."""

    def __init__(self, config: PoolConfig, arena, opts, stats, tag: int) -> None:
        super().__init__(config, arena, opts, stats, tag)
        kv = config.kv
        # One model layer stack per group (each group is its own set of layers).
        self.model = TinyModel(num_layers=kv.num_layers * len(config.groups),
                               num_kv_heads=kv.num_kv_heads, head_size=kv.head_size,
                               dtype=arena.dtype, seed=opts.seed,
                               max_positions=config.max_model_len + 1)

    def run(self, seqs) -> None:
        """K/V of each request's scheduled tokens into the arena, and decode
        attention for decode tokens; leaves each request's context after them."""
        st = self.stats
        model = self.model
        cpu = time.thread_time
        for seq in seqs:
            n = seq.scheduled
            start = seq.num_computed
            toks = seq.tokens[start:start + n]
            t0 = cpu()
            k, v, ctx_after = model.kv(toks, start, seq.ctx)
            self.write(seq, start, k, v)
            t1 = cpu()
            st.kv_s += t1 - t0
            if n == 1 and start >= seq.prompt_len:   # a decode step (not a recompute)
                check_before = st.check_s
                self._decode_attention(seq, start, toks[0])
                st.attention_s += cpu() - t1 - (st.check_s - check_before)
            seq.ctx = ctx_after

    def started(self, seq) -> None:
        """A request admitted without hits."""
        seq.ctx = self.model.context([])

    def _decode_attention(self, seq, pos: int, token: int) -> None:
        """Attention of the decode token over the request's blocks; sampled
        steps are checked against attention over a contiguous recompute."""
        L = self.num_layers
        q = self.model.query(token, pos, seq.ctx)
        check = self.rng.random() < self.opts.check_decode
        for (g, bs, window), view in zip(self.groups, self.views):
            out = paged_attention(q[g * L:(g + 1) * L], view, seq.tables[g], bs, pos + 1,
                                  window=window)
            if check:
                t0 = time.thread_time()
                if g == 0:
                    k_ref, v_ref, _ = self.model.kv(seq.tokens[:pos + 1], 0,
                                                    self.model.context([]))
                self.stats.decode_checks += 1
                ref = attention(q[g * L:(g + 1) * L], k_ref[g * L:(g + 1) * L].astype(np.float32),
                                v_ref[g * L:(g + 1) * L].astype(np.float32), window=window)
                if not np.allclose(out, ref, rtol=1e-4, atol=1e-5):
                    # Its blocks hold wrong K/V (written into from outside): the
                    # step is discarded and healed like a bad hit.  Otherwise
                    # the paged attention itself is wrong.
                    table = seq.tables[g]
                    bad = mismatching_blocks(view, table, bs, k_ref[g * L:(g + 1) * L],
                                             v_ref[g * L:(g + 1) * L])
                    if bad:
                        self.bad_hits(seq, [table[i] for i in bad], "of the request hold "
                                      f"wrong K/V, found by the decode check at position "
                                      f"{pos} (group {g})")
                    else:
                        self.stats.decode_mismatches += 1
                        self.error(f"{seq.rid}: paged attention at position {pos} (group {g}) "
                                    f"differs from the contiguous recompute by "
                                    f"{float(np.abs(out - ref).max()):.3g}")
                self.stats.check_s += time.thread_time() - t0

    def admitted(self, seq, num_hit: int) -> None:
        """A request admitted with `num_hit` hit tokens: recompute the hit
        tokens' K/V and compare them bitwise with the hit blocks (all, or a
        `verify_hits` sample).  Leaves the request's context after its hits."""
        t0 = time.thread_time()
        st = self.stats
        L = self.num_layers
        checks = self.hit_blocks(seq, num_hit)
        seq.ctx = self.model.context(seq.tokens[:num_hit])
        expected = self._expected_kv(seq.tokens, checks)
        for g, bs, idx in checks:
            table, view = seq.tables[g], self.views[g]
            st.hit_blocks_checked += len(idx)
            layers = slice(g * L, (g + 1) * L)
            bad = []
            for i in idx:
                k, v = expected[i * bs, (i + 1) * bs]
                if mismatching_blocks(view, [table[i]], bs, k[layers], v[layers]):
                    bad.append(i)
            if bad:
                self.bad_hits(seq, [table[i] for i in bad], "hit in the prefix cache hold the "
                              f"wrong K/V (group {g})")
        st.check_s += time.thread_time() - t0

    def _expected_kv(self, tokens: list[int], checks) -> dict:
        """K/V from scratch for the token ranges of the blocks in `checks`
        ({(start, end): (k, v)}): each run of adjacent blocks is computed
        from the context of the tokens before it, so a sample costs only
        the sampled blocks (plus a cheap prefix scan), not the whole prefix."""
        ranges = sorted({(i * bs, (i + 1) * bs) for _, bs, idx in checks for i in idx})
        runs: list[list[int]] = []
        for lo, hi in ranges:
            if runs and lo <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], hi)
            else:
                runs.append([lo, hi])
        model = self.model
        out = {}
        for lo, hi in runs:
            k, v, _ = model.kv(tokens[lo:hi], lo, model.context(tokens[:lo]))
            for a, b in ranges:
                if lo <= a and b <= hi:
                    out[a, b] = (k[:, a - lo:b - lo], v[:, a - lo:b - lo])
        return out


class LoadOnlyCompute(ComputeBase):
    """No model (EngineOptions.load_only, for load generators such as
    scripts/numa_stress.py): the scheduled tokens' blocks get this worker's
    writer stamp, and hits are counted, but no K/V is computed or checked."""

    model = None

    def run(self, seqs) -> None:
        writer = self.arena.writer
        for seq in seqs:
            start, n = seq.num_computed, seq.scheduled
            for (g, bs, _) in self.groups:
                writer[seq.tables[g][start // bs:-(-(start + n) // bs)]] = self.tag

    def started(self, seq) -> None:
        """Nothing to set up without a model."""

    def admitted(self, seq, num_hit: int) -> None:
        self.hit_blocks(seq, num_hit)   # counts the cross-worker hits (nothing sampled)

    def fingerprint(self) -> str:
        return "load-only"
