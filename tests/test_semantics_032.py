"""A pool of vLLM 0.32's semantics (`vllm_version = "0.32.0"`), on tiny
pools: where it differs from 0.14 (kvshm/core/semantics.py), and the
config's refusals.  The 0.32 conformance set (tests/test_conformance.py)
checks the same against vLLM 0.32's own manager on whole workloads; these
tests pin each difference alone, each next to what a 0.14 pool does."""

from __future__ import annotations

import pytest

from kvshm import ConfigError, InvalidArgument, KVCacheManager, Request
from kvshm.core.specs import (ChunkedLocalSpec, CrossAttentionSpec, FullSpec, MambaSpec,
                              SinkFullSpec, SlidingWindowSpec)
from kvshm.ops.errors import HandshakeError
from kvshm.pool.lifecycle import adopt_pool, create_pool
from kvshm.service.process import CoordinatorProcess
from kvshm.service.sync_client import connect_sync

from helpers import assert_clean, make_config, tokens


def pool(version: str = "0.32.0", **changes) -> KVCacheManager:
    return KVCacheManager(make_config(vllm_version=version, **changes))


# -- the free queue ---------------------------------------------------------------------


def test_freed_blocks_without_a_hash_are_reused_first():
    """a: 2 full blocks (cached) and a partial one; b: 1 partial block.
    Freeing them puts the uncached blocks at the head, the last one freed
    first (LIFO), and the cached ones at the tail as before."""
    with pool() as m:
        h = m.make_hasher()
        a, b = Request("a", tokens(0, 10), h), Request("b", tokens(100, 102), h)
        assert m.allocate_slots(a, 10) == ([1, 2, 3],)
        assert m.allocate_slots(b, 2) == ([4],)
        m.free(a)
        assert m.block_pool.free_queue() == [3, 5, 6, 7, 8, 9, 2, 1]
        m.free(b)
        assert m.block_pool.free_queue() == [4, 3, 5, 6, 7, 8, 9, 2, 1]
        c = Request("c", tokens(200, 206), h)
        assert m.allocate_slots(c, 6) == ([4, 3],)
        assert_clean(m)
    with pool("0.14.0") as m:                    # the same calls on 0.14: all to the tail
        h = m.make_hasher()
        a, b = Request("a", tokens(0, 10), h), Request("b", tokens(100, 102), h)
        m.allocate_slots(a, 10)
        m.allocate_slots(b, 2)
        m.free(a)
        m.free(b)
        assert m.block_pool.free_queue() == [5, 6, 7, 8, 9, 3, 2, 1, 4]


def test_with_caching_off_every_freed_block_is_reused_first():
    with pool(enable_caching=False) as m:
        a = Request("a", tokens(0, 10))
        assert m.allocate_slots(a, 10) == ([1, 2, 3],)
        m.free(a)
        assert m.block_pool.free_queue() == [3, 2, 1, 4, 5, 6, 7, 8, 9]
        assert_clean(m)


def test_an_adopted_pool_keeps_the_order_of_prepended_blocks(pool_name):
    """The free queue is rebuilt from the blocks' stamps on adoption: the
    blocks put at the head (stamps below the never-used blocks' 0) stay
    there, in the same order."""
    cfg = make_config(vllm_version="0.32.0")
    first = create_pool(cfg, pool_name)
    m = first.mgr
    h = m.make_hasher()
    for rid, start in (("a", 0), ("b", 100)):
        r = Request(rid, tokens(start, start + 6), h)
        m.allocate_slots(r, 6)
        r.num_computed_tokens = 6
        m.mark_computed(r)          # (a coordinator's pool: its K/V are written)
        m.free(r)
    want = m.block_pool.free_queue()
    # a: [1 cached, 2 partial], then b: [2 cached, 3 partial]; 3 went to the head
    assert want == [3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert m.segment.free_stamp[3] < m.segment.free_stamp[4] == 0 < m.segment.free_stamp[1]
    first.close(unlink=False)
    second = adopt_pool(cfg, pool_name)     # repair rebuilds the queue from the stamps
    try:
        assert second.mgr.block_pool.free_queue() == want
        assert_clean(second.mgr)
        r = Request("c", tokens(200, 202), second.mgr.make_hasher())
        assert second.mgr.allocate_slots(r, 2) == ([3],)
    finally:
        second.close()


# -- admission ------------------------------------------------------------------------


def test_a_waiting_request_is_admitted_only_if_its_whole_sequence_fits():
    """9 free blocks; r holds 5.  w (20 tokens: 5 blocks) asks for its
    first chunk of 8 tokens (2 blocks): 0.32 refuses, its whole sequence
    does not fit; without the flag, or on 0.14, the chunk is given."""
    for version, must_fit, want in (("0.32.0", True, None), ("0.32.0", False, ([6, 7],)),
                                    ("0.14.0", True, ([6, 7],))):
        with pool(version) as m:
            h = m.make_hasher()
            m.allocate_slots(Request("r", tokens(0, 20), h), 20)
            w = Request("w", tokens(100, 120), h)
            got = m.allocate_slots(w, 8, full_sequence_must_fit=must_fit, waiting=True)
            assert got == want, (version, must_fit)
            if got is None:
                assert m.num_free_blocks == 4 and m.get_block_ids("w") == ([],)
            assert_clean(m)


def test_the_watermark_holds_back_waiting_requests_while_others_run():
    """watermark 0.3 of 10 blocks: 3 blocks a waiting request must leave
    free; it does not apply to running requests or when nothing runs."""
    with pool(watermark=0.3) as m:
        h = m.make_hasher()
        m.allocate_slots(Request("r", tokens(0, 16), h), 16)          # 4 blocks, 5 free
        w = Request("w", tokens(100, 112), h)                          # 3 blocks
        assert m.allocate_slots(w, 12, waiting=True, has_scheduled_reqs=True) is None
        assert m.allocate_slots(w, 12, waiting=True, has_scheduled_reqs=False) == ([5, 6, 7],)
        r2 = Request("r2", tokens(200, 208), h)
        assert m.allocate_slots(r2, 8) == ([8, 9],)                    # running: no watermark
        assert_clean(m)


@pytest.mark.parametrize("version", ["0.32.0", "0.14.0"])
def test_reserved_blocks_stay_free_after_an_allocation(version):
    """9 free blocks; w needs 3.  With 7 reserved it is refused and nothing
    changes; with 6 it gets them.  A running request's step that needs no
    block is refused too while fewer blocks are free than reserved (the
    shortest paths do not skip the check).  A negative count is refused."""
    with pool(version) as m:
        h = m.make_hasher()
        w = Request("w", tokens(0, 12), h)
        assert m.allocate_slots(w, 12, reserved_blocks=7) is None
        assert m.num_free_blocks == 9 and m.get_block_ids("w") == ([],)
        assert m.allocate_slots(w, 12, reserved_blocks=6) == ([1, 2, 3],)
        w.num_computed_tokens = 10                                 # 2 slots left in block 3
        assert m.allocate_slots(w, 1, reserved_blocks=10) is None
        assert m.allocate_slots(w, 1, reserved_blocks=6) == ([],)
        with pytest.raises(InvalidArgument, match="reserved_blocks=-1"):
            m.allocate_slots(w, 1, reserved_blocks=-1)
        assert m.num_free_blocks == 6
        assert_clean(m)


def test_reserved_blocks_over_ipc(pool_name):
    with CoordinatorProcess(make_config(vllm_version="0.32.0"), name=pool_name) as proc:
        with connect_sync(proc.socket) as c:
            c.add_request("w", tokens(0, 12))
            assert c.allocate_slots("w", 12, reserved_blocks=7) is None
            assert c.allocate_slots("w", 12, reserved_blocks=6) == [[1, 2, 3]]
            with pytest.raises(InvalidArgument, match="reserved_blocks=-1"):
                c.allocate_slots("w", 1, reserved_blocks=-1)
            assert c.stats().num_free_blocks == 6


def test_0_32_takes_an_allocation_that_only_adopts_hits():
    for version in ("0.32.0", "0.14.0"):
        with pool(version) as m:
            h = m.make_hasher()
            a = Request("a", tokens(0, 13), h)
            m.allocate_slots(a, 13)
            m.free(a)
            b = Request("b", tokens(0, 13), h)
            hits, n = m.get_computed_blocks(b)
            assert n == 12
            if version == "0.32.0":
                assert m.allocate_slots(b, 0, n, hits) == ([],)
                continue
            with pytest.raises(InvalidArgument, match="num_new_tokens must be > 0"):
                m.allocate_slots(b, 0, n, hits)


def test_prefix_cache_stats_count_admissions_not_lookups():
    """0.32 counts a request's query once, when it is admitted, with the
    hits it used; a lookup whose allocation fails counts nothing."""
    with pool() as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 9), h)
        m.allocate_slots(a, 9, waiting=True)
        b = Request("b", tokens(0, 9), h)
        hits, n = m.get_computed_blocks(b)
        assert m.prefix_cache_stats == {"queries": 1, "hits": 0, "query_tokens": 9,
                                        "hit_tokens": 0}
        m.allocate_slots(b, 1, n, hits, waiting=True)
        assert m.prefix_cache_stats == {"queries": 2, "hits": 1, "query_tokens": 18,
                                        "hit_tokens": 8}
    with pool("0.14.0") as m:
        h = m.make_hasher()
        b = Request("b", tokens(0, 9), h)
        m.get_computed_blocks(b)
        assert m.prefix_cache_stats["queries"] == 1


# -- probes -----------------------------------------------------------------------------


def test_common_prefix_blocks_are_zeros_without_cascade_attention():
    for version, want in (("0.32.0", [0]), ("0.14.0", [2])):
        with pool(version) as m:
            h = m.make_hasher()
            m.allocate_slots(Request("a", tokens(0, 9), h), 9)
            b = Request("b", tokens(0, 9), h)
            hits, n = m.get_computed_blocks(b)
            m.allocate_slots(b, 9 - n, n, hits)
            assert m.get_num_common_prefix_blocks("a") == want, version


def test_estimate_cached_tokens_is_the_end_of_the_last_cached_block():
    with pool() as m:
        h = m.make_hasher()
        r = Request("r", tokens(0, 10), h)
        assert m.estimate_cached_tokens("r") == 0
        m.allocate_slots(r, 10)                  # blocks 0-1 full and cached, 2 partial
        assert m.estimate_cached_tokens("r") == 8
        m.evict_blocks([2])                      # the second leaves the cache
        assert m.estimate_cached_tokens("r") == 4
        assert m.estimate_cached_tokens("nobody") == 0


# -- the config ------------------------------------------------------------------------


@pytest.mark.parametrize("changes,message", [
    (dict(vllm_version="0.20.0"), "vllm_version: must be one of 0.14.0, 0.32.0"),
    (dict(vllm_version="0.32.0", watermark=1.0), r"watermark: must be in \[0, 1\)"),
    (dict(vllm_version="0.32.0", watermark=-0.1), r"watermark: must be in \[0, 1\)"),
    (dict(watermark=0.1), "vLLM 0.14.0 has no watermark"),
    (dict(vllm_version="0.32.0", groups=(SinkFullSpec(4, 8),)),
     "takes no sink_full group: vLLM 0.32.0 cannot build its own sink-attention manager"),
    (dict(max_in_flight_tokens=64), "vLLM 0.14.0 has no admission gate"),
    (dict(vllm_version="0.32.0", max_in_flight_tokens=0), "max_in_flight_tokens"),
])
def test_the_config_refuses_what_0_32_does_not_have(changes, message):
    with pytest.raises(ConfigError, match=message):
        make_config(**changes)


def test_0_32_takes_full_mla_chunked_local_and_cross_attention_groups():
    make_config(vllm_version="0.32.0", groups=(FullSpec(4), ChunkedLocalSpec(4, 8)))
    make_config(vllm_version="0.32.0", groups=(SlidingWindowSpec(4, 8),))
    make_config(vllm_version="0.32.0", groups=(MambaSpec(4),))
    make_config(vllm_version="0.32.0", groups=(FullSpec(4), SlidingWindowSpec(4, 8)))
    make_config(vllm_version="0.32.0", groups=(FullSpec(4), MambaSpec(4)), use_eagle=True,
                enable_caching=False)       # (no hybrid lookups without a cache)
    make_config(vllm_version="0.32.0", groups=(FullSpec(4), CrossAttentionSpec(4)),
                enable_caching=False)


# -- the handshake ----------------------------------------------------------------------


@pytest.mark.parametrize("pool_release,engine", [("0.14.0", "0.32.0"), ("0.32.0", "0.14.0")])
def test_an_engine_of_another_release_is_refused_at_the_handshake(pool_name, pool_release,
                                                                  engine):
    """A session that names its vLLM release (the plugin does) is refused by
    a pool of another release's semantics, both named; one of the pool's
    own, or one that names none (kvshm's own clients), is let in."""
    cfg = make_config(vllm_version=pool_release, num_blocks=16)
    with CoordinatorProcess(cfg, name=pool_name) as proc:
        with pytest.raises(HandshakeError, match=(
                rf"this pool reproduces vLLM {pool_release}'s allocation semantics, not vLLM "
                rf"{engine}'s, the engine's \(serve a pool with vllm_version = \"{engine}\"")):
            connect_sync(proc.socket, vllm_version=engine)
        for release in (pool_release, ""):
            with connect_sync(proc.socket, vllm_version=release) as c:
                assert c.config.vllm_version == pool_release
                assert c.stats().num_sessions == 1


# -- windowed groups ----------------------------------------------------------------------


def test_a_sliding_window_caches_only_the_tail_a_replay_can_hit():
    """Window 8, 4-token blocks: a hit needs 2 contiguous blocks ending where
    a replay of the 12-token prompt resumes (token 11, so blocks 0-1).  0.32
    caches those two, not block 2; 0.14 caches all three."""
    for version, cached in (("0.32.0", [True, True, False]), ("0.14.0", [True, True, True])):
        with pool(version, groups=(SlidingWindowSpec(4, 8),)) as m:
            r = Request("r", tokens(0, 12), m.make_hasher())
            m.allocate_slots(r, 12)
            got = [m.block_pool.block_hash(b) is not None for b in m.get_block_ids("r")[0]]
            assert got == cached, version
            b = Request("b", tokens(0, 12), m.make_hasher())
            assert m.get_computed_blocks(b)[1] == 8       # the replay hits the tail
            assert_clean(m)


def test_windowed_groups_are_admitted_for_their_window_and_the_tokens_in_flight():
    """A 40-token request on 9 free blocks: its whole sequence needs 10,
    but a window of 8 with 4 tokens in flight holds at most 4 (3 + 1 for a
    window that starts inside a block), so 0.32 admits its first chunk."""
    with pool(groups=(SlidingWindowSpec(4, 8),), max_in_flight_tokens=4) as m:
        w = Request("w", tokens(0, 40), m.make_hasher())
        assert m.allocate_slots(w, 8, full_sequence_must_fit=True, waiting=True) == ([1, 2],)
    with pool(max_in_flight_tokens=4) as m:                   # full attention: no cap
        w = Request("w", tokens(0, 40), m.make_hasher())
        assert m.allocate_slots(w, 8, full_sequence_must_fit=True, waiting=True) is None
    with pool(groups=(ChunkedLocalSpec(4, 8),), max_in_flight_tokens=4) as m:
        w = Request("w", tokens(0, 40), m.make_hasher())      # chunk 8 + 4: 3 blocks
        assert m.allocate_slots(w, 8, full_sequence_must_fit=True, waiting=True) == ([1, 2],)


def test_mamba_caches_the_replay_state_and_defers_a_hit_cached_this_step():
    """Mamba, 4-token blocks: a 10-token prompt's replay resumes from token
    9, so only the state block ending at token 8 (block 1) is cached.  A
    request hitting it in the same step is not admitted; in the next step
    (`new_step_starts`) it is.  0.14 caches every state block and defers
    nothing."""
    with pool(groups=(MambaSpec(4),)) as m:
        a = Request("a", tokens(0, 10), m.make_hasher())
        m.allocate_slots(a, 10)
        held = m.get_block_ids("a")[0]
        assert [m.block_pool.block_hash(b) is not None for b in held] == [False, True, False]
        b = Request("b", tokens(0, 10), m.make_hasher())
        hits, n = m.get_computed_blocks(b)
        assert n == 8
        assert m.allocate_slots(b, 2, n, hits, waiting=True) is None
        m.new_step_starts()
        hits, n = m.get_computed_blocks(b)
        assert m.allocate_slots(b, 2, n, hits, waiting=True) is not None
        assert_clean(m)
    with pool("0.14.0", groups=(MambaSpec(4),)) as m:
        a = Request("a", tokens(0, 10), m.make_hasher())
        m.allocate_slots(a, 10)
        b = Request("b", tokens(0, 10), m.make_hasher())
        hits, n = m.get_computed_blocks(b)
        assert m.allocate_slots(b, 2, n, hits) is not None


def test_a_hybrid_lookup_reports_the_prefix_a_window_has_not_cached():
    """Full attention + a window of 8 (4-token blocks).  a's 16 tokens:
    full attention caches 4 blocks, the window only the 2 its replay (token
    15) reaches, blocks 1-2.  b extends a: full attention hits 16 tokens,
    the window only 12, so the hit is 12 and the shared prefix that the
    window has not cached ends at 16 (`shared_prefix_boundary`); b's window
    then caches the tail reaching it too."""
    with pool(groups=(FullSpec(4), SlidingWindowSpec(4, 8)), num_blocks=32) as m:
        h = m.make_hasher()
        a = Request("a", tokens(0, 16), h)
        m.allocate_slots(a, 16)
        sw = m.get_block_ids("a")[1]
        assert [m.block_pool.block_hash(b) is not None for b in sw] == [False, True, True, False]
        b = Request("b", tokens(0, 16) + tokens(500, 508), h)
        hits, n = m.get_computed_blocks(b)
        assert n == 12 and len(hits[0]) == 3
        assert m.shared_prefix_boundary == b.shared_prefix_boundary == 16
        m.allocate_slots(b, 12, n, hits)
        sw_b = m.get_block_ids("b")[1]
        assert m.block_pool.block_hash(sw_b[3]) is not None       # reaches 16
        assert_clean(m)


def test_serve_s_flag_names_the_pool_s_release():
    """`--vllm-version` (kvshm serve, kvshm run) overrides the shape's."""
    import argparse
    from kvshm.config import PoolSource, add_pool_arguments, resolve_config
    ap = argparse.ArgumentParser()
    add_pool_arguments(ap)
    args = ap.parse_args(["--preset", "tiny", "--vllm-version", "0.32.0", "--num-blocks", "64"])
    assert resolve_config(PoolSource.from_args(args)).vllm_version == "0.32.0"
    args = ap.parse_args(["--preset", "tiny", "--num-blocks", "64"])
    assert resolve_config(PoolSource.from_args(args)).vllm_version == "0.14.0"
    with pytest.raises(SystemExit):
        ap.parse_args(["--preset", "tiny", "--vllm-version", "0.20.0"])
