"""Tenants: quotas (refused like a full pool, others untouched), request ids
scoped per tenant, and their accounting across a coordinator restart."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import make_config, tokens
from kvshm import DuplicateRequest, InvalidArgument, UnknownRequest
from kvshm.core.errors import ConfigError
from kvshm.ops.errors import HandshakeError, NotOwner
from kvshm.ops.tenants import parse_quota
from kvshm.service.process import CoordinatorProcess
from kvshm.service.resume import Reconnect
from kvshm.service.sync_client import connect_sync

CFG = make_config(num_blocks=41, max_num_seqs=16)     # 40 usable blocks of 4 tokens
QUOTAS = ("--tenant-quota", "a=25%", "--tenant-quota", "=5")


@pytest.fixture
def proc(pool_name):
    with CoordinatorProcess(CFG, name=pool_name, extra_args=QUOTAS) as proc:
        yield proc


def client(proc, tenant="", **kw):
    return connect_sync(proc.socket, hash_algorithm=CFG.hash_algorithm,
                        hash_seed=CFG.hash_seed, tenant=tenant,
                        reconnect=Reconnect(initial_delay=0.01, max_delay=0.1, timeout=20),
                        **kw)


def tenant_stats(name):
    out = subprocess.run([sys.executable, "-m", "kvshm", "stats", name, "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["tenants"]


def test_a_tenant_over_its_quota_is_refused_and_others_are_not(proc):
    with client(proc, "a") as a, client(proc, "b") as b, client(proc) as d:
        a.add_request("x", tokens(0, 36))
        assert len(a.allocate_slots("x", 36)[0]) == 9        # 9 of its 10 blocks
        a.add_request("y", tokens(100, 108))
        assert a.allocate_slots("y", 8) is None              # 2 more: over the quota
        assert a.admit("y", 8).new_block_ids is None         # Admit too
        b.add_request("x", tokens(200, 260))                 # b: unlimited, same id
        assert len(b.allocate_slots("x", 60)[0]) == 15
        assert a.allocate_slots("y", 4) is not None          # the 10th block fits
        d.add_request("z", tokens(300, 324))
        assert d.allocate_slots("z", 24) is None             # the default tenant: 5 blocks
        assert d.allocate_slots("z", 20) is not None
        a.free("x", preempted=True)                          # a preempts its own request
        assert a.allocate_slots("y", 8) is not None
        st = tenant_stats(proc.name)
    assert st["a"]["quota"] == 10 and st["a"]["quota_refusals"] == 2
    assert st["a"]["blocks"] == 2 and st["a"]["preemptions"] == 1   # y: 8 tokens
    assert st["b"]["quota"] == -1 and st["b"]["blocks"] == 15 and st["b"]["quota_refusals"] == 0
    assert st[""]["quota"] == 5 and st[""]["blocks"] == 5 and st[""]["quota_refusals"] == 1


def test_a_tenant_cannot_tell_whether_another_s_request_id_exists(proc):
    with client(proc, "a") as a, client(proc, "b") as b, client(proc, "a") as a2, \
            client(proc) as d:
        a.add_request("secret", tokens(0, 8))
        a.allocate_slots("secret", 8)
        for other in (b, d):
            with pytest.raises(UnknownRequest) as e:     # as if it did not exist
                other.get_block_ids("secret")
            assert e.value.request_id == "secret" and "\x1f" not in str(e.value)
            with pytest.raises(UnknownRequest):
                other.free("secret")
            other.add_request("secret", tokens(50, 58))  # its own, no DuplicateRequest
            assert other.allocate_slots("secret", 8) is not None
        with pytest.raises(NotOwner):                    # the same tenant: another session's
            a2.get_block_ids("secret")
        with pytest.raises(DuplicateRequest) as e:
            a2.add_request("secret", tokens(0, 8))
        assert "\x1f" not in str(e.value) and "'secret'" in str(e.value)
        # Nobody can name another tenant's scoped id directly.
        for c in (a, b, d):
            with pytest.raises(InvalidArgument, match="U\\+001F"):
                c.add_request("0\x1fsecret", tokens(0, 8))
            with pytest.raises(UnknownRequest):
                c.get_block_ids("0\x1fsecret")
        assert len(a.get_block_ids("secret")[0]) == 2


def test_tenant_accounting_survives_a_coordinator_restart(proc):
    with client(proc, "a") as a:
        a.add_request("x", tokens(0, 36))
        a.allocate_slots("x", 36)
        before = tenant_stats(proc.name)["a"]
        proc.kill()
        proc.restart()
        assert len(a.get_block_ids("x")[0]) == 9           # resumed, restored
        after = tenant_stats(proc.name)["a"]
        assert after["blocks"] == before["blocks"] == 9 and after["quota"] == 10
        a.add_request("y", tokens(100, 108))
        assert a.allocate_slots("y", 8) is None             # the quota still holds
        a.free("x")
        assert tenant_stats(proc.name)["a"]["blocks"] == 0


@pytest.mark.parametrize("spec, message", [
    ("a", "is not NAME=BLOCKS"), ("a=-1", "block count >= 0"), ("a=120%", "0..100"),
    ("a=x", "block count"), ("x" * 65 + "=1", "at most 64 bytes"),
])
def test_bad_quota_specs_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_quota(spec, 40)


def test_quota_specs():
    assert parse_quota("team-a=40%", 1000) == ("team-a", 400)
    assert parse_quota("=7", 1000) == ("", 7)
    assert parse_quota("a=b=3", 10) == ("a=b", 3)


def test_serve_refuses_a_bad_quota_and_a_bad_tenant(pool_name, proc):
    out = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--preset", "tiny",
                          "--num-blocks", "64", "--name", pool_name + "-q", "--tenant-quota",
                          "a=lots"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "tenant_quota: 'a=lots'" in out.stderr
    with pytest.raises(HandshakeError, match="at most 64 bytes"):
        client(proc, "t" * 65)
