"""The simulated scheduler of the invariant tests: `Sim` drives one KVCacheManager as a
scheduler would and checks what check_segment cannot see; `random_op` is one seeded-random step.

Used by test_invariants.py (its hypothesis and seeded-random drivers) and
test_check.py (mutations under a concurrent checker); imported as `invariant_sim`.
"""

from __future__ import annotations

import collections
import random

import pytest

from kvshm import (
    ChunkedLocalSpec,
    CrossAttentionSpec,
    FullSpec,
    InvalidArgument,
    KVCacheManager,
    MambaSpec,
    MLASpec,
    PoolConfig,
    Request,
    RequestTooLong,
    SinkFullSpec,
    SlidingWindowSpec,
    check_segment,
)
from kvshm.core.state import FLAG_CACHED, FRAME_CACHE_STAMP_WORD, SEQ_WORD

MAX_SEQS = 10        # request-table slots of every test pool
MAX_LIVE = 8         # live (waiting + running) requests the simulation keeps
ENC_MAX = 40         # max_encoder_len of the encoder-decoder pool


def _cfg(groups, *, num_blocks=40, hbs=4, max_model_len=96, **kw) -> PoolConfig:
    return PoolConfig(num_blocks=num_blocks, hash_block_size=hbs, max_model_len=max_model_len,
                      groups=tuple(groups), max_num_seqs=MAX_SEQS, **kw)


CONFIGS: dict[str, PoolConfig] = {
    "full": _cfg([FullSpec(4)]),
    "full_nocache": _cfg([FullSpec(4)], enable_caching=False),
    "mla": _cfg([MLASpec(4)]),
    "sink_full": _cfg([SinkFullSpec(4, sink_len=8)], num_blocks=42),
    "sliding_window": _cfg([SlidingWindowSpec(4, sliding_window=10)]),
    "chunked_local": _cfg([ChunkedLocalSpec(4, attention_chunk_size=16)]),
    "mamba": _cfg([MambaSpec(4)], num_blocks=24),
    "mamba_spec2": _cfg([MambaSpec(4, num_speculative_blocks=2)], num_blocks=30),
    "mamba_nocache": _cfg([MambaSpec(96)], num_blocks=6, enable_caching=False),
    "hybrid_full_sw": _cfg([FullSpec(4), SlidingWindowSpec(4, sliding_window=12)],
                           num_blocks=64),
    "hybrid_full8_sw4": _cfg([FullSpec(8), SlidingWindowSpec(4, sliding_window=12)],
                             num_blocks=60),
    "hybrid_full_mamba": _cfg([FullSpec(4), MambaSpec(4)], num_blocks=56),
    "hybrid_full_chunked": _cfg([FullSpec(4), ChunkedLocalSpec(4, attention_chunk_size=16)],
                                num_blocks=64),
    "hybrid4_full_full_sw_sw": _cfg([FullSpec(4), FullSpec(4),
                                     SlidingWindowSpec(4, sliding_window=12),
                                     SlidingWindowSpec(4, sliding_window=12)],
                                    num_blocks=110),
    "encdec_nocache": _cfg([FullSpec(4), CrossAttentionSpec(4)], num_blocks=50,
                           enable_caching=False, max_encoder_len=ENC_MAX),
    "eagle": _cfg([FullSpec(4)], use_eagle=True),
    "eagle_hybrid_sw": _cfg([FullSpec(4), SlidingWindowSpec(4, sliding_window=8)],
                            num_blocks=64, use_eagle=True),
    "dcp2": _cfg([FullSpec(2)], dcp_world_size=2, hbs=4),
}

_rng = random.Random(20240601)
# A few "system prompts" that requests share, so prefix hits happen.
SYSTEM_PROMPTS = [[_rng.randrange(1000, 2000) for _ in range(n)] for n in (33, 24, 17)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def skipped_tokens(spec, total_computed: int) -> int:
    """Tokens out of the attention window once `total_computed` are done
    (vLLM's get_num_skipped_tokens), modelled independently of kvshm."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, total_computed - spec.sliding_window + 1)
    if isinstance(spec, ChunkedLocalSpec):
        return total_computed // spec.attention_chunk_size * spec.attention_chunk_size
    if isinstance(spec, MambaSpec):
        return max(0, total_computed - 1)
    return 0


# Names of the segments every Sim created (to check none is left behind;
# other processes on the host may create kvshm segments of their own).
CREATED: list[str] = []


class Sim:
    """A small scheduler over one KVCacheManager, with invariant checks."""

    def __init__(self, config: PoolConfig) -> None:
        self.cfg = config
        self.m = KVCacheManager(config)
        CREATED.append(self.m.segment.name)
        self.hasher = self.m.make_hasher()
        self.reqs: dict[str, Request] = {}
        self.enc: dict[str, int] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.done: list[str] = []
        self.counter = 0
        self.cross = [isinstance(g, CrossAttentionSpec) for g in config.groups]
        self.extra = [g.block_size * g.num_speculative_blocks if isinstance(g, MambaSpec) else 0
                      for g in config.groups]
        self.bs = [config.effective_block_size(g) for g in range(len(config.groups))]
        self.max_len = config.max_model_len
        self.log: list[str] = []
        self.stats: collections.Counter[str] = collections.Counter()

    def close(self) -> None:
        self.m.close()

    # -- helpers -------------------------------------------------------------
    def _note(self, text: str) -> None:
        self.log.append(text)
        del self.log[:-40]

    def _pick(self, pool: list[str], idx: int) -> str | None:
        return pool[idx % len(pool)] if pool else None

    def live(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- operations ----------------------------------------------------------
    def add_request(self, sys_idx: int, share: float, suffix: list[int], salt: str | None,
                    lora: str | None, history: int, enc: int, skip_read: bool) -> None:
        if self.live() >= MAX_LIVE:
            return
        if history >= 0 and self.done:
            # A follow-up turn: the whole conversation so far, then new tokens.
            src = self.reqs[self.done[history % len(self.done)]]
            prompt = src.all_token_ids[: self.max_len // 2] + suffix
            salt, lora = src.cache_salt, src.lora_name
        elif sys_idx < len(SYSTEM_PROMPTS):
            sp = SYSTEM_PROMPTS[sys_idx]
            prompt = sp[: max(1, int(len(sp) * share))] + suffix
        else:
            prompt = list(suffix)
        prompt = prompt[: self.max_len // 2 + 8]
        rid = f"r{self.counter}"
        self.counter += 1
        self.reqs[rid] = Request(rid, prompt, self.hasher, lora_name=lora, cache_salt=salt,
                                 skip_reading_prefix_cache=skip_read)
        self.enc[rid] = enc
        self.waiting.append(rid)
        self._note(f"add {rid} len={len(prompt)} salt={salt} lora={lora} skip={skip_read}")

    def schedule(self, idx: int, chunk: int, lookahead: int, delay_cache: bool,
                 external: bool = False) -> None:
        """Schedule a waiting (new or preempted) request: prefix lookup, then
        allocate_slots with the hits.  `external`: the rest of the prompt but
        its last token comes from a remote prefill (P/D), loaded at once."""
        rid = self._pick(self.waiting, idx)
        if rid is None:
            return
        m, r = self.m, self.reqs[rid]
        assert r.num_computed_tokens == 0
        before = (m.num_free_blocks, m.block_pool.free_queue())
        hits, n = m.get_computed_blocks(r)
        assert (m.num_free_blocks, m.block_pool.free_queue()) == before, \
            "get_computed_blocks changed the free queue"
        self._check_hits(r, hits, n)
        if n:
            self.stats["prefix_hit"] += 1
            if any(0 in h for h in hits):
                self.stats["hit_with_nulls"] += 1
        pending = r.num_tokens - n
        enc = self.enc[rid] if any(self.cross) else 0
        ext = pending - 1 if external and not enc else 0
        if ext > 0:
            num_new, lookahead, delay_cache = 0, 0, True
        else:
            num_new = min(pending, chunk)
        self._note(f"schedule {rid} hit={n} new={num_new} ext={ext} la={lookahead} "
                   f"delay={delay_cache} enc={enc} hits={[list(h) for h in hits]}")
        new = m.allocate_slots(r, num_new, num_new_computed_tokens=n, new_computed_blocks=hits,
                               num_lookahead_tokens=lookahead,
                               num_external_computed_tokens=ext,
                               delay_cache_blocks=delay_cache, num_encoder_tokens=enc)
        self._note(f"  -> {None if new is None else [list(g) for g in new]} "
                   f"free={m.num_free_blocks}")
        if new is None:
            self.stats["new_request_no_room"] += 1
            return
        self._check_allocation(r, new, n + ext + num_new + lookahead, enc, n + ext)
        self.waiting.remove(rid)
        self.running.append(rid)
        if ext > 0:
            # The remote KV arrived: commit it, as the scheduler does.
            self.stats["external_load"] += 1
            m.cache_blocks(r, n + ext)
            r.num_computed_tokens = n + ext
        elif num_new == pending:
            r.num_computed_tokens = r.num_tokens
            r.append_token_ids([self.counter % 13])  # the first sampled token
        else:
            r.num_computed_tokens = n + num_new
        self._maybe_finish(rid)

    def step(self, idx: int, chunk: int, drafts: int, accepted: int, lookahead: int) -> None:
        """One scheduler step of a running request: a prefill chunk, or a
        decode step with `drafts` speculative tokens."""
        rid = self._pick(self.running, idx)
        if rid is None:
            return
        m, r = self.m, self.reqs[rid]
        pending = r.num_tokens - r.num_computed_tokens
        assert pending >= 1
        if pending > 1:
            num_new, drafts = min(pending, chunk), 0
        else:
            num_new = 1 + drafts
        self._note(f"step {rid} computed={r.num_computed_tokens} tokens={r.num_tokens} "
                   f"new={num_new} la={lookahead}")
        new = m.allocate_slots(r, num_new, num_lookahead_tokens=lookahead)
        self._note(f"  -> {None if new is None else [list(g) for g in new]} "
                   f"free={m.num_free_blocks}")
        if new is None:
            self.stats["decode_no_room"] += 1
            self.preempt_rid(rid)
            return
        self._check_allocation(r, new, r.num_computed_tokens + num_new + lookahead, 0,
                               r.num_computed_tokens)
        if num_new < pending:
            r.num_computed_tokens += num_new
        else:
            a = min(accepted, drafts)
            r.num_computed_tokens += pending + a
            r.append_token_ids([(self.counter + i) % 11 for i in range(a + 1)])
        self._maybe_finish(rid)

    def _maybe_finish(self, rid: str) -> None:
        r = self.reqs[rid]
        if r.num_tokens >= self.max_len - 6:
            self.finish_rid(rid)

    def remove_skipped(self, idx: int) -> None:
        rid = self._pick(self.running, idx)
        if rid is None:
            return
        self._note(f"remove_skipped {rid} {self.reqs[rid].num_computed_tokens}")
        free = self.m.num_free_blocks
        self.m.remove_skipped_blocks(rid, self.reqs[rid].num_computed_tokens)
        if self.m.num_free_blocks > free:
            self.stats["trimmed"] += 1

    def cache(self, idx: int) -> None:
        rid = self._pick(self.running, idx)
        if rid is None:
            return
        r = self.reqs[rid]
        self._note(f"cache_blocks {rid} {r.num_computed_tokens}")
        self.m.cache_blocks(r, r.num_computed_tokens)

    def finish(self, idx: int, from_waiting: bool) -> None:
        rid = self._pick(self.waiting if from_waiting else self.running, idx)
        if rid is not None:
            self.finish_rid(rid)

    def finish_rid(self, rid: str) -> None:
        self._note(f"free {rid}")
        self.m.free(self.reqs[rid])
        (self.waiting if rid in self.waiting else self.running).remove(rid)
        self.done.append(rid)
        assert not any(self.m.get_block_ids(rid)), "a freed request still holds blocks"

    def preempt(self, idx: int) -> None:
        rid = self._pick(self.running, idx)
        if rid is not None:
            self.preempt_rid(rid)

    def preempt_rid(self, rid: str) -> None:
        self._note(f"preempt {rid}")
        r = self.reqs[rid]
        self.m.free(r)
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.running.remove(rid)
        self.waiting.append(rid)

    def evict(self, ids: list[int]) -> None:
        m = self.m
        self._note(f"evict {ids}")
        before = (m.num_free_blocks, m.block_pool.free_queue())
        if any(m.block_pool.block_hash(b) is not None for b in ids):
            self.stats["evicted_cached"] += 1
        m.evict_blocks(ids)
        assert (m.num_free_blocks, m.block_pool.free_queue()) == before, \
            "evict_blocks moved blocks"
        for b in ids:
            assert m.block_pool.block_hash(b) is None, f"block {b} still cached after eviction"

    def reset(self) -> None:
        m = self.m
        all_free = m.num_free_blocks == self.cfg.num_blocks - 1
        ok = m.reset_prefix_cache()
        self._note(f"reset_prefix_cache -> {ok}")
        assert ok == all_free, f"reset_prefix_cache returned {ok} with " \
                               f"{m.num_free_blocks} of {self.cfg.num_blocks} blocks free"
        if ok:
            self.stats["reset_ok"] += 1
            assert m.block_pool.num_cached_blocks == 0

    # -- bad calls: a typed error, raised before anything changes ------------------
    def _state(self):
        m = self.m
        seg = m.segment
        header = bytearray(seg.header)
        # A bracket may open and close, and a frame leave its scratch words.
        for word in (SEQ_WORD, FRAME_CACHE_STAMP_WORD):
            header[word * 8:word * 8 + 8] = bytes(8)
        arrays = [bytes(getattr(seg, name)) for name in seg.layout.offsets if name != "undo"]
        return (bytes(header), arrays, m.block_pool.free_queue(), m.block_pool.num_free_blocks,
                {rid: m.get_block_ids(rid) for rid in self.reqs},
                [dict(g.num_cached_block) for g in m.groups.managers],
                dict(m.table.slot_of),
                [dict(m.block_pool.hash_to_block(g).entries())
                 for g in range(len(self.cfg.groups))])

    def bad_call(self, kind: int, idx: int) -> None:
        m, cfg = self.m, self.cfg
        rid = self._pick(self.running, idx)
        r = self.reqs[rid] if rid else None
        fresh = Request(f"bad{self.counter}", SYSTEM_PROMPTS[1][:9], self.hasher)
        self.counter += 1
        groups = len(cfg.groups)
        caching = cfg.enable_caching
        call = None
        error: type[Exception] = InvalidArgument
        if kind == 0:
            call = lambda: m.allocate_slots(r or fresh, -1)  # noqa: E731
        elif kind == 1:
            call = lambda: m.allocate_slots(fresh, 0)  # noqa: E731
        elif kind == 2 and r is not None and caching and not r.skip_reading_prefix_cache:
            twin = Request("twin", list(r.all_token_ids), self.hasher, lora_name=r.lora_name,
                           cache_salt=r.cache_salt)
            hits, n = m.get_computed_blocks(twin)
            if n and any(hits):  # hits for a request that already holds blocks
                call = lambda: m.allocate_slots(r, 1, n, hits)  # noqa: E731
        elif kind == 3:
            call = lambda: m.allocate_slots(  # noqa: E731
                fresh, 4, 4, tuple([1] for _ in range(groups + 1)))
        elif kind == 4:
            call = lambda: m.allocate_slots(  # noqa: E731
                fresh, 4, 4, tuple([cfg.num_blocks] for _ in range(groups)))
        elif kind == 5 and not any(self.cross):
            error = RequestTooLong
            call = lambda: m.allocate_slots(  # noqa: E731
                fresh, 1, num_external_computed_tokens=self.max_len + 64)
        elif kind == 6 and any(self.cross):
            error = RequestTooLong
            call = lambda: m.allocate_slots(fresh, 4, num_encoder_tokens=ENC_MAX + 1)  # noqa
        elif kind == 7 and r is not None:
            call = lambda: m.remove_skipped_blocks(r.request_id, -1)  # noqa: E731
        elif kind == 8 and r is not None and caching:
            call = lambda: m.cache_blocks(r, r.num_tokens + 1)  # noqa: E731
        elif kind == 9:
            cached = [b for b in range(cfg.num_blocks) if m.block_pool.block_hash(b)]
            call = lambda: m.evict_blocks(cached[:2] + [cfg.num_blocks])  # noqa: E731
        elif kind == 10 and caching:
            nohash = Request(fresh.request_id, fresh.all_token_ids, None)
            call = lambda: m.allocate_slots(nohash, 9)  # noqa: E731
        elif kind == 11:
            long_id = Request("x" * 65, [1, 2, 3], self.hasher)
            call = lambda: m.allocate_slots(long_id, 3)  # noqa: E731
        elif kind == 12 and r is not None:
            tokens, hashes = list(r.all_token_ids), list(r.block_hashes)
            with pytest.raises(InvalidArgument):
                r.append_token_ids([1, 2, 2**64])   # outside every hashing's range
            assert (r.all_token_ids, r.block_hashes) == (tokens, hashes)
        if call is None:
            return
        self._note(f"bad call {kind}")
        before = self._state()
        with pytest.raises(error):
            call()
        assert self._state() == before, f"bad call {kind} changed the pool"
        self.stats["bad_call"] += 1

    def common_prefix(self) -> None:
        if not self.running:
            return
        rid = self.running[0]
        got = self.m.get_num_common_prefix_blocks(rid)
        blocks = self.m.get_block_ids(rid)
        assert len(got) == len(blocks)
        for g, (k, held) in enumerate(zip(got, blocks)):
            assert 0 <= k <= len(held), f"group {g}: {k} common blocks of {len(held)}"

    # -- checks --------------------------------------------------------------
    def _check_hits(self, r: Request, hits, n: int) -> None:
        m, cfg = self.m, self.cfg
        assert len(hits) == len(cfg.groups)
        if not cfg.enable_caching or r.skip_reading_prefix_cache:
            assert n == 0 and not any(hits)
            return
        assert 0 <= n <= r.num_tokens - 1, f"hit of {n} tokens for {r.num_tokens}"
        pool = m.block_pool
        for g, blocks in enumerate(hits):
            bs = self.bs[g]
            assert n % bs == 0, f"group {g}: hit length {n} not a multiple of {bs}"
            assert len(blocks) == n // bs, \
                f"group {g}: {len(blocks)} hit blocks for a hit of {n} tokens"
            ghashes = m.groups.managers[g].group_hashes(r.block_hashes)
            for i, b in enumerate(blocks):
                if b == 0:
                    continue
                assert pool.block_hash(b) == ghashes[i], \
                    f"group {g}: hit block {b} at {i} is not cached under the request's hash"
                assert m.segment.hash_group[b] == g

    def _check_allocation(self, r: Request, new, num_tokens: int, enc: int,
                          computed: int) -> None:
        """After a successful allocate_slots: the new blocks are the tail of
        the request's lists, the lists cover `num_tokens` slots, and exactly
        the blocks out of the window for `computed` tokens are null."""
        held = self.m.get_block_ids(r.request_id)
        need = min(num_tokens, self.max_len)
        for g, (ids, blocks) in enumerate(zip(new, held)):
            assert 0 not in ids, f"group {g}: the null block was allocated"
            assert blocks[len(blocks) - len(ids):] == list(ids), \
                f"group {g}: new blocks {ids} are not the tail of {blocks}"
            if self.cross[g]:
                if enc:
                    assert len(blocks) == _cdiv(enc, self.bs[g]), \
                        f"cross group {g}: {len(blocks)} blocks for {enc} encoder tokens"
                continue
            want = _cdiv(need + self.extra[g], self.bs[g])
            assert len(blocks) >= want, \
                f"group {g}: {len(blocks)} blocks cannot hold {need} tokens ({want} needed)"
            k = skipped_tokens(self.cfg.groups[g], computed) // self.bs[g]
            assert all(b == 0 for b in blocks[:k]), \
                f"group {g}: blocks out of the window for {computed} tokens kept: {blocks}"
            assert all(b != 0 for b in blocks[k:]), \
                f"group {g}: a block inside the window for {computed} tokens is null: {blocks}"

    def check(self) -> None:
        m = self.m
        rep = check_segment(m.segment, m.block_pool)
        assert rep.clean, "check_segment: " + rep.summary() + "\nlast ops:\n  " + \
            "\n  ".join(self.log)
        assert not m.segment.words[SEQ_WORD] & 1, "mutation counter left odd"
        pool = m.block_pool
        assert pool.num_free_blocks == len(pool.free_queue()) == m.segment.get("num_free_blocks")
        # Python-side lists agree with the request table in the segment.
        table = m.table
        owner_group: dict[int, int] = {}
        for g, mgr in enumerate(m.groups.managers):
            for rid, blocks in mgr.req_to_blocks.items():
                assert rid in table.slot_of, f"group {g}: {rid} has blocks but no slot"
                row, cached = table.read_row(table.slot_of[rid], g)
                assert row == blocks, f"group {g} {rid}: table row {row} != list {blocks}"
                assert cached == mgr.num_cached_block.get(rid, -1)
                nonnull = [b for b in blocks if b]
                assert len(nonnull) == len(set(nonnull)), \
                    f"group {g} {rid}: a block appears twice in {blocks}"
                for b in nonnull:
                    assert owner_group.setdefault(b, g) == g, \
                        f"block {b} is held in groups {owner_group[b]} and {g}"
                    assert not m.segment.flags[b] & FLAG_CACHED or \
                        m.segment.hash_group[b] == g, f"block {b} cached for another group"
        # A cached block a request holds is cached under that request's own
        # hash for that position (its own commit, or a hit on an equal prefix).
        for rid in self.running:
            r = self.reqs[rid]
            for g, blocks in enumerate(m.get_block_ids(rid)):
                if self.cross[g]:
                    continue
                ghashes = m.groups.managers[g].group_hashes(r.block_hashes)
                for i, b in enumerate(blocks):
                    h = pool.block_hash(b) if b else None
                    if h is not None:
                        assert i < len(ghashes) and h == ghashes[i], \
                            f"{rid} group {g}: block {b} at {i} is cached under another hash"
        for rid in self.done:
            assert not any(m.get_block_ids(rid)), f"finished {rid} holds blocks"
        for rid in self.waiting:
            assert not any(m.get_block_ids(rid)), f"waiting {rid} holds blocks"
        assert len(table.slot_of) <= MAX_SEQS


def random_op(sim: Sim, rnd: random.Random) -> None:
    """Apply one operation drawn from `rnd` (weighted like a busy scheduler) to `sim`."""
    r = rnd.random()
    i = rnd.randrange(8)
    if r < 0.14:
        sim.add_request(rnd.randrange(len(SYSTEM_PROMPTS) + 1), rnd.choice([0.3, 0.7, 1.0]),
                        [rnd.randrange(8) for _ in range(rnd.randint(1, 14))],
                        rnd.choice([None, None, None, "salt-a"]),
                        rnd.choice([None, None, None, "lora-x"]),
                        rnd.randint(-3, 4), rnd.randint(1, ENC_MAX), rnd.random() < 0.1)
    elif r < 0.32:
        sim.schedule(i, rnd.choice([5, 16, 64, 200]), rnd.choice([0, 0, 0, 3]),
                     rnd.random() < 0.15, rnd.random() < 0.15)
    elif r < 0.70:
        sim.step(i, rnd.choice([3, 8, 64]), rnd.randint(0, 3), rnd.randint(0, 3),
                 rnd.choice([0, 0, 2, 4]))
    elif r < 0.75:
        sim.remove_skipped(i)
    elif r < 0.80:
        sim.cache(i)
    elif r < 0.86:
        sim.finish(i, rnd.random() < 0.2)
    elif r < 0.90:
        sim.preempt(i)
    elif r < 0.95:
        sim.evict([rnd.randrange(sim.cfg.num_blocks) for _ in range(rnd.randint(0, 6))])
    elif r < 0.96:
        sim.reset()
    elif r < 0.98:
        sim.bad_call(rnd.randrange(13), i)
    else:
        sim.common_prefix()
