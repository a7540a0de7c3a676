"""The vLLM plugin's backend on a shared pool (kvshm/vllm/remote.py) without
vLLM: a waiting request's lookup of tokens another session is computing,
its wait, its budget and deadline, the polling that spares round trips, and the two
ways the scheduler is told (skipped by the plugin's connector, or a None
allocation); and the plugin's settings, read when its binding is made."""

from __future__ import annotations

import contextlib
import re
import time

import pytest

from helpers import make_config, tokens
from kvshm.core.request import Request
from kvshm.pool.segment import remove_segment
from kvshm.service.process import CoordinatorProcess
from kvshm.service.sync_client import connect_sync
from kvshm.core.errors import ConfigError
from kvshm.vllm.binding import EMBEDDED, PoolBinding
from kvshm.vllm.remote import PoolSessionLost, RemoteBackend

CFG = make_config(num_blocks=64, max_num_seqs=16)


class VllmRequest:
    """The attributes of vLLM's Request that the backend reads."""

    def __init__(self, rid: str, prompt, hasher) -> None:
        own = Request(rid, prompt, hasher)
        self.request_id = rid
        self.block_hashes = list(own.block_hashes)
        self.num_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.lora_request = None
        self.cache_salt = None
        self.skip_reading_prefix_cache = False
        self.status = None


@pytest.fixture
def proc(pool_name):
    with CoordinatorProcess(CFG, name=pool_name) as proc:
        yield proc


def backend(proc, **kw) -> RemoteBackend:
    client = connect_sync(proc.socket, hash_algorithm=CFG.hash_algorithm,
                          hash_seed=CFG.hash_seed)
    b = RemoteBackend(client, **kw)
    frames = [0]
    batch, call = client.batch, client.call

    def counted_batch(ops, *a, **k):
        frames[0] += 1
        return batch(ops, *a, **k)

    def counted_call(op, *a, **k):
        frames[0] += 1
        return call(op, *a, **k)

    client.batch, client.call = counted_batch, counted_call
    b.frames = frames
    return b


def allocate(b: RemoteBackend, req, hits, n_computed: int):
    return b.allocate_slots(req, req.num_tokens - n_computed, n_computed, hits, 0, 0, False, 0)


@contextlib.contextmanager
def in_flight(proc, skips: bool = True, **kw):
    """A writer session with `tokens(0, 20)` in flight (5 full blocks of 4,
    cached but not computed), and a backend that waits for 8 or more
    tokens in flight (`kw`: its deadline and poll; `skips`: whether the
    scheduler skips a waiting request, as with the plugin's connector).
    Yields (writer, backend, prompt)."""
    prompt = tokens(0, 20)
    with connect_sync(proc.socket, hash_algorithm=CFG.hash_algorithm,
                      hash_seed=CFG.hash_seed) as writer:
        writer.add_request("w", prompt)
        assert writer.allocate_slots("w", 20) is not None
        b = backend(proc, wait_in_flight=8, **kw)
        b.skips_waiting = skips
        try:
            yield writer, b, prompt
        finally:
            b.client.close()


@pytest.mark.parametrize("skips", [True, False], ids=["skipped", "allocation-none"])
def test_a_lookup_of_tokens_in_flight_waits_then_hits_them(proc, skips):
    with in_flight(proc, skips, in_flight_deadline=30,
                   in_flight_poll=0.05) as (writer, b, prompt):
        req = VllmRequest("r", prompt + tokens(100, 103), b.client.make_hasher())
        hits, n, _ = b.get_computed_blocks(req)
        assert n == 0
        assert b.waits("r") and b.in_flight_waits == 1
        if not skips:
            # Without the connector the scheduler learns it from the allocation.
            b.get_computed_blocks(req)
            assert allocate(b, req, hits, 0) is None
        before, t0 = b.frames[0], time.monotonic()
        assert b.get_computed_blocks(req) == (hits, 0, 0)
        assert b.waits("r")
        if skips:
            # Looked up again within the poll period: the last answer, no
            # round trip.  A step that schedules nothing then sleeps until
            # the next lookup is due; one that schedules something does not.
            assert b.frames[0] == before
            t0 = time.monotonic()
            b.idle(5)
            assert time.monotonic() - t0 < 0.02
            b.idle(0)
            assert 0 < time.monotonic() - t0 <= 0.2
        else:
            # The step would hold nothing else: sleep until the lookup is due,
            # then look up.
            assert b.frames[0] == before + 1 and time.monotonic() - t0 >= 0.01
        writer.advance("w", 20)          # the writer's K/V are in: the blocks are ready
        time.sleep(0.06)
        hits, n, _ = b.get_computed_blocks(req)
        assert n == 20 and not b.waits("r")
        assert allocate(b, req, hits, 20) is not None
        assert b.in_flight_waits == 1
        b.free(req)
        writer.free("w")


@pytest.mark.parametrize("skips", [True, False], ids=["skipped", "allocation-none"])
def test_a_request_held_for_tokens_in_flight_counts_once_in_the_pool_s_stats(proc, skips):
    """The lookups that hold a request back (each poll while it waits) are
    not counted; the one that admits it is, with the hits it found (an
    engine on its own cache would have looked it up once)."""
    with in_flight(proc, skips, in_flight_deadline=30,
                   in_flight_poll=0.001) as (writer, b, prompt):
        start = writer.stats()
        req = VllmRequest("r", prompt + tokens(100, 103), b.client.make_hasher())
        for _ in range(5):
            hits, n, _ = b.get_computed_blocks(req)
            assert b.holds("r") and n == 0
            if skips:
                assert b.waits("r")
            else:
                assert allocate(b, req, hits, 0) is None
            time.sleep(0.002)
        held = writer.stats()
        assert (held.queries, held.query_tokens) == (start.queries, start.query_tokens)
        writer.advance("w", 20)
        hits, n, _ = b.get_computed_blocks(req)
        assert n == 20 and not b.holds("r") and not b.waits("r")
        assert allocate(b, req, hits, 20) is not None
        end = writer.stats()
        assert (end.queries - start.queries, end.query_tokens - start.query_tokens,
                end.hits - start.hits, end.hit_tokens - start.hit_tokens) == (1, 23, 1, 20)
        b.free(req)
        writer.free("w")


def test_a_request_past_its_wait_s_deadline_is_counted_with_what_it_found(proc):
    with in_flight(proc, in_flight_deadline=0.05, in_flight_poll=0.001) as (writer, b, prompt):
        start = writer.stats()
        req = VllmRequest("r", prompt, b.client.make_hasher())
        b.get_computed_blocks(req)
        assert b.waits("r")
        time.sleep(0.08)
        hits, n, _ = b.get_computed_blocks(req)   # past its budget: computes them itself
        assert not b.holds("r") and not b.waits("r")
        end = writer.stats()
        assert (end.queries - start.queries, end.query_tokens - start.query_tokens) == (1, 20)
        b.free(req)
        writer.free("w")


def test_a_waiting_request_computes_the_tokens_itself_at_its_deadline(proc):
    with in_flight(proc, in_flight_deadline=0.1, in_flight_poll=0.01) as (writer, b, prompt):
        req = VllmRequest("r", prompt, b.client.make_hasher())
        hits, n, _ = b.get_computed_blocks(req)
        assert b.waits("r")
        time.sleep(0.15)
        hits, n, _ = b.get_computed_blocks(req)
        assert n == 0 and not b.waits("r")      # past its deadline: it computes them
        assert allocate(b, req, hits, 0) is not None
        # Fewer tokens in flight than wait_in_flight: no wait at all.
        quick = backend(proc, wait_in_flight=64)
        other = VllmRequest("o", prompt, quick.client.make_hasher())
        quick.get_computed_blocks(other)
        assert not quick.waits("o") and quick.in_flight_waits == 0
        b.free(req)
        writer.free("w")
        quick.client.close()


def test_a_request_waits_no_longer_than_computing_the_tokens_itself(pool_name):
    """The wait's budget is the in-flight tokens times the engine's own cost
    per token, measured from the end of a step's scheduling to the end of
    its forward pass on steps of at least 32 tokens (seconds over tokens,
    decaying sums), and capped by the deadline (the whole deadline until a
    step is measured)."""
    cfg = make_config(num_blocks=256, max_num_seqs=16, max_model_len=512)
    with CoordinatorProcess(cfg, name=pool_name) as proc, \
            connect_sync(proc.socket, hash_algorithm=cfg.hash_algorithm,
                         hash_seed=cfg.hash_seed) as writer:
        b = backend(proc, wait_in_flight=8, in_flight_deadline=30, in_flight_poll=0.005)
        b.skips_waiting = True
        hasher = b.client.make_hasher()
        assert b.token_cost is None and b.wait_budget(20) == 30
        own = VllmRequest("own", tokens(1000, 1300), hasher)     # a 300-token prefill
        assert allocate(b, own, None, 0) is not None
        time.sleep(0.3)                                           # its forward pass
        b.step_computed({"own": 300})
        first = b.token_cost
        assert 0.001 <= first < 0.01                              # about 1 ms a token
        assert b.wait_budget(20) == pytest.approx(20 * first)
        assert b.wait_budget(10**6) == 30                         # the deadline caps it
        # A small step (a decode step) measures nothing.
        own.num_computed_tokens, own.num_tokens = 300, 301
        assert b.allocate_slots(own, 1, 0, None, 0, 0, False, 0) is not None
        time.sleep(0.05)
        b.step_computed({"own": 1})
        assert b.token_cost == first
        # A slower step of 40 tokens raises the cost, weighed by its tokens.
        short = VllmRequest("short", tokens(2000, 2040), hasher)
        assert allocate(b, short, None, 0) is not None
        time.sleep(0.12)                                          # 3 ms a token
        b.step_computed({"short": 40})
        assert first < b.token_cost < 0.12 / 40
        assert b.token_cost < 2 * first                           # the long step weighs most
        first = b.token_cost
        # Tokens in flight: the request waits about 20 ms, then computes them.
        prompt = tokens(0, 20)
        writer.add_request("w", prompt)
        writer.allocate_slots("w", 20)
        req = VllmRequest("r", prompt + tokens(100, 103), hasher)   # 20 tokens in flight
        t0 = time.monotonic()
        b.get_computed_blocks(req)
        assert b.waits("r")
        while True:
            hits, n, _ = b.get_computed_blocks(req)
            if not b.waits("r"):
                break
            b.idle(0)
        waited = time.monotonic() - t0
        assert 20 * first <= waited < 2.0 and n == 0
        assert allocate(b, req, hits, 0) is not None
        b.free(req)
        b.free(own)
        b.free(short)
        writer.free("w")
        b.client.close()


def test_the_backend_rides_through_a_restart_its_session_survives(proc):
    """What the pool holds of each request is the client's mirror, restored
    after a restart: the request goes on where it was."""
    b = backend(proc)
    req = VllmRequest("r", tokens(0, 10), b.client.make_hasher())
    hits, n, _ = b.get_computed_blocks(req)
    assert allocate(b, req, hits, n) is not None
    req.num_computed_tokens = 10
    b.step_computed({"r": 10})
    proc.kill()
    proc.restart()
    assert b.get_block_ids("r") == [[1, 2, 3]]     # from the backend's own block ids
    b.free(req)                                     # its computed count goes first
    assert b.client.stats().num_requests == 0 and len(b.client.requests) == 0
    assert len(b.client.restarts) == 1
    b.close()


def test_a_session_lost_in_a_restart_stops_the_backend_for_good(proc, pool_name):
    """A restarted coordinator that cannot give the session back has lost
    the block tables the scheduler holds: the backend refuses every call
    from then on instead of going on as a fresh session."""
    b = backend(proc)
    req = VllmRequest("r", tokens(0, 10), b.client.make_hasher())
    hits, n, _ = b.get_computed_blocks(req)
    assert allocate(b, req, hits, n) is not None
    proc.kill()
    remove_segment(pool_name, force=True)
    proc.restart()
    other = VllmRequest("o", tokens(50, 60), b.client.make_hasher())
    try:
        with pytest.raises(PoolSessionLost, match="restart the engine"):
            b.get_computed_blocks(other)
        for later in (lambda: b.get_computed_blocks(other), lambda: allocate(b, req, None, 0),
                      lambda: b.get_block_ids("r"), lambda: b.free(req)):
            with pytest.raises(PoolSessionLost):
                later()
        assert b.client.stats().num_requests == 0     # nothing re-added behind its back
    finally:
        b.close()


PLUGIN_SETTINGS = ("KVSHM_CONNECT_TIMEOUT", "KVSHM_NODE", "KVSHM_WAIT_IN_FLIGHT",
                   "KVSHM_IN_FLIGHT_DEADLINE")


@pytest.mark.parametrize("name, value, says", [
    ("KVSHM_IN_FLIGHT_DEADLINE", "2s", "KVSHM_IN_FLIGHT_DEADLINE: '2s' is not a number"),
    ("KVSHM_IN_FLIGHT_DEADLINE", "-1", "must be a finite number >= 0 (got -1)"),
    ("KVSHM_IN_FLIGHT_DEADLINE", "inf", "must be a finite number >= 0 (got inf)"),
    ("KVSHM_WAIT_IN_FLIGHT", "1.5", "KVSHM_WAIT_IN_FLIGHT: '1.5' is not a whole number"),
    ("KVSHM_WAIT_IN_FLIGHT", "-3", "must be a finite number >= 0 (got -3)"),
    ("KVSHM_CONNECT_TIMEOUT", "nan", "KVSHM_CONNECT_TIMEOUT: must be a finite number"),
    ("KVSHM_NODE", "-2", "KVSHM_NODE: must be a finite number >= -1 (got -2)"),
    ("KVSHM_NODE", "one", "KVSHM_NODE: 'one' is not a whole number"),
])
def test_a_bad_plugin_setting_stops_the_engine_at_its_start_naming_it(monkeypatch, name,
                                                                      value, says):
    for other in PLUGIN_SETTINGS:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(says)):
        PoolBinding("/nowhere/pool.sock")
    PoolBinding(EMBEDDED)              # an engine's own embedded pool reads none of them


def test_the_plugin_settings_default_when_unset_or_blank(monkeypatch):
    for name in PLUGIN_SETTINGS:
        monkeypatch.setenv(name, "  ")
    b = PoolBinding("/nowhere/pool.sock")
    assert (b.connect_timeout, b.node, b.wait_in_flight, b.in_flight_deadline) == (30, -1, 128, 2)
    monkeypatch.setenv("KVSHM_WAIT_IN_FLIGHT", " 0 ")      # never wait
    monkeypatch.setenv("KVSHM_IN_FLIGHT_DEADLINE", "0.5")
    monkeypatch.setenv("KVSHM_NODE", "1")
    b = PoolBinding("/nowhere/pool.sock")
    assert (b.node, b.wait_in_flight, b.in_flight_deadline) == (1, 0, 0.5)
