"""Tenants that must prove who they are (`kvshm serve --tenant NAME=PROOF`,
kvshm/service/tenant_auth.py): each way of proving one, every refusal (a
refused claim changes nothing, is counted and logged with its reason, and
tells the client only the tenant), the config file's `[serve]` table, and a
fuzzed handshake that never gets in without a proof."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
import string
import subprocess
import sys
import time

import pytest

from helpers import make_config, tokens
from kvshm.config import serve_options
from kvshm.core.errors import ConfigError
from kvshm.core.metrics import read_metrics
from kvshm.core.specs import PoolConfig
from kvshm.ops.errors import Forbidden, HandshakeError
from kvshm.service.client import connect
from kvshm.service.client_core import InFlight, resume_hello
from kvshm.service.handshake import make_hello
from kvshm.service.process import CoordinatorProcess
from kvshm.service.resume import Reconnect, RequestMirror
from kvshm.service.tenant_auth import peer_credentials
from kvshm.service.sync_client import connect_sync
from kvshm.service.tenant_auth import Peer, TenantAuth, parse_proof, read_token_file
from kvshm.vllm.binding import PoolBinding

CFG = make_config(num_blocks=64, max_num_seqs=32)
ME = os.getuid()
MY_GID = os.getgid()
OTHER = 54321        # a uid and gid this process has not


def token_file(tmp_path, text="s3cret-token", mode=0o600, name="a.token"):
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def kw(**extra):
    return dict(hash_algorithm=CFG.hash_algorithm, hash_seed=CFG.hash_seed, resume=False,
                **extra)


def sync_session(coord, tenant, **extra):
    """A blocking client's session as `tenant`: one allocation, its reply."""
    with connect_sync(coord.socket_path, tenant=tenant, **kw(**extra)) as c:
        c.add_request("s", tokens(0, 8))
        return c.allocate_slots("s", 8)


# -- declarations ------------------------------------------------------------------------
def test_proof_specs(tmp_path):
    tok = token_file(tmp_path)
    assert parse_proof("a=uid:1001").value == 1001
    assert parse_proof("team-b=gid:0").kind == "gid"
    p = parse_proof(f"a=token:{tok}")
    assert (p.kind, p.value, p.source) == ("token", "s3cret-token", f"token:{tok}")
    assert parse_proof("=uid:5").tenant == ""          # the default tenant
    auth = TenantAuth.from_specs(["a=uid:1", f"a=token:{tok}", "b=gid:2"])
    assert auth.declared and auth.tenants == ["a", "b"]
    assert all("s3cret" not in line for line in auth.describe())   # files, not tokens


@pytest.mark.parametrize("spec, message", [
    ("a", "is not NAME=uid:N"),
    ("a=1001", "the proof must be uid:N, gid:N or token:FILE"),
    ("a=user:1001", "the proof must be"),
    ("a=uid:", "uid must be a number"),
    ("a=uid:-1", "uid must be a number"),
    ("a=uid:4294967295", "uid must be a number"),
    ("a=gid:x", "gid must be a number"),
    ("a=token:", "token: needs a file"),
    ("a=token:/nonexistent/file", "cannot read the token file"),
    ("a\x1fb=uid:1", r"without U\+001F"),
    ("x" * 65 + "=uid:1", "64 bytes"),
])
def test_bad_proof_specs_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_proof(spec)


def test_token_files_must_be_private_and_non_empty(tmp_path):
    with pytest.raises(ConfigError, match=r"mode 0644.*chmod 600"):
        read_token_file(token_file(tmp_path, mode=0o644))
    with pytest.raises(ConfigError, match="mode 0640"):
        read_token_file(token_file(tmp_path, mode=0o640, name="g"))
    with pytest.raises(ConfigError, match="is empty"):
        read_token_file(token_file(tmp_path, text="  ", name="e"))
    with pytest.raises(ConfigError, match="not a regular file"):
        read_token_file(tmp_path)                     # a directory
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_token_file(fifo)                         # refused, not waited on
    bad = tmp_path / "bin"
    bad.write_bytes(b"\xff\xfe")
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match="not text"):
        read_token_file(bad)
    assert read_token_file(token_file(tmp_path, mode=0o400, name="ro")) == "s3cret-token"


def test_refusal_decides_each_claim():
    auth = TenantAuth([parse_proof("a=uid:10"), parse_proof("a=gid:20"),
                       parse_proof("b=token:x", read_token=lambda _: "tok-b")])
    me = Peer(1, 10, frozenset({99}))
    grouped = Peer(2, 11, frozenset({20, 21}))
    nobody = Peer(3, 12, frozenset({30}))
    assert auth.refusal("a", me, "", admin=False) is None             # by uid
    assert auth.refusal("a", grouped, "", admin=False) is None        # by a group
    assert "proves none of uid:10, gid:20" in auth.refusal("a", nobody, "", admin=False)
    assert auth.refusal("a", nobody, "tok-b", admin=False)            # b's token is not a's
    assert auth.refusal("b", nobody, "tok-b", admin=False) is None    # by token
    assert "a token" in auth.refusal("b", me, "tok-x", admin=False)
    assert "no token" in auth.refusal("b", me, "", admin=False)
    assert "not declared" in auth.refusal("c", me, "", admin=False)
    assert auth.refusal("", nobody, "", admin=False) is None          # default: open
    assert auth.refusal("c", nobody, "", admin=True) is None          # admin: any tenant
    locked = TenantAuth([parse_proof("=uid:10")])
    assert locked.refusal("", nobody, "", admin=False)                # default declared
    assert locked.refusal("", me, "", admin=False) is None
    open_pool = TenantAuth()
    assert not open_pool.declared
    assert open_pool.refusal("anything", nobody, "", admin=False) is None


def test_the_hello_carries_the_token_and_a_resume_keeps_it():
    hello = make_hello("/x.sock", tenant="a", tenant_token=" tok \n")
    assert hello.tenant_token == "tok"
    flight = InFlight(RequestMirror())
    again = resume_hello(hello, "resume", flight)
    assert again.tenant_token == "tok" and again.resume_token == "resume"
    assert again.resume_from == 0            # no call in flight: no reply wanted
    assert make_hello("/x.sock").tenant_token == ""


# -- the coordinator -------------------------------------------------------------------------
@pytest.fixture
def auth(tmp_path):
    tok = token_file(tmp_path)
    return TenantAuth.from_specs([f"by-uid=uid:{ME}", f"by-gid=gid:{MY_GID}",
                                  f"by-token=token:{tok}", f"other=uid:{OTHER}",
                                  f"other=gid:{OTHER}"])


async def test_each_proof_lets_its_tenant_in(coordinator, auth):
    coord = await coordinator(CFG, tenant_auth=auth)
    for tenant, extra in (("by-uid", {}), ("by-gid", {}),
                          ("by-token", {"tenant_token": "s3cret-token"}), ("", {})):
        async with await connect(coord.socket_path, tenant=tenant, **kw(**extra)) as c:
            await c.add_request("r", tokens(0, 8))
            assert await c.allocate_slots("r", 8) is not None
        assert await asyncio.to_thread(sync_session, coord, tenant, **extra) is not None
    assert read_metrics(coord.metrics.words)["handshakes_refused"] == 0


@pytest.mark.parametrize("tenant, extra", [
    ("other", {}),                                     # neither its uid nor its gid
    ("by-token", {}),                                  # no token
    ("by-token", {"tenant_token": "s3cret-tokeN"}),    # a wrong one
    ("by-uid", {"tenant_token": "s3cret-token"}),      # by-token's token, not by-uid's proof
    ("undeclared", {}),
    ("undeclared", {"tenant_token": "s3cret-token"}),
])
async def test_an_unproven_claim_is_refused_and_changes_nothing(coordinator, auth, caplog,
                                                                tenant, extra):
    if tenant == "by-uid":   # (this process proves by-uid: claim other with that token)
        tenant = "other"
    coord = await coordinator(CFG, tenant_auth=auth)
    before = read_metrics(coord.metrics.words)
    with caplog.at_level(logging.WARNING, logger="kvshm.coordinator"):
        with pytest.raises(Forbidden) as e:
            await connect(coord.socket_path, tenant=tenant, **kw(**extra))
        with pytest.raises(Forbidden):   # (the blocking client, off the loop's thread)
            await asyncio.to_thread(sync_session, coord, tenant, **extra)
    msg = str(e.value)
    assert msg == f"this session may not act as tenant {tenant!r}"   # the tenant, no reason
    after = read_metrics(coord.metrics.words)
    assert after["handshakes_refused"] == before["handshakes_refused"] + 2
    assert any(f"tenant {tenant!r}" in r.message and
               ("not declared" in r.message or "proves none" in r.message)
               for r in caplog.records)                              # the reason: logged
    assert coord.sessions == {}                                      # nobody got in
    assert after["tenants"] == before["tenants"]                     # no tenant slot taken
    assert tenant not in after["tenants"] and len(coord.mgr.table) == 0


async def test_a_fuzzed_handshake_never_gets_in_without_a_proof(coordinator, auth):
    """Random tenant names and tokens (near misses of the real ones among
    them): only the declared tenant this process proves, or the token's own
    tenant with its exact token, or the default tenant, get a session."""
    coord = await coordinator(CFG, tenant_auth=auth)
    rng = random.Random(2312)
    alphabet = string.ascii_letters + string.digits + "-_. \t\x00é"
    names = ["by-token", "other", "undeclared", "by-uid", "by-gid", "", "By-token",
             "by-token ", "by-tok", "other\x00"]
    toks = ["", "s3cret-token", "s3cret-token ", "S3cret-token", "s3cret-toke", "s3cret-token\x00",
            "x" * 4096]
    admitted = refused = 0
    for i in range(int(os.environ.get("KVSHM_FUZZ_HANDSHAKES", "150"))):
        tenant = rng.choice(names) if rng.random() < 0.6 else "".join(
            rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        token = rng.choice(toks) if rng.random() < 0.7 else "".join(
            rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        proven = (tenant in ("by-uid", "by-gid", "")
                  or (tenant == "by-token" and token.strip() == "s3cret-token"))
        try:
            c = await asyncio.to_thread(connect_sync, coord.socket_path, tenant=tenant,
                                        tenant_token=token, **kw())
        except HandshakeError as e:   # Forbidden, or a name no tenant may have
            assert not proven, (tenant, token)
            assert isinstance(e, Forbidden) or "tenant names are" in str(e), e
            refused += 1
            continue
        assert proven, (tenant, token)
        admitted += 1
        c.close()
    assert admitted and refused


# -- kvshm serve -----------------------------------------------------------------------------
def serve(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "kvshm", "serve", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_serve_refuses_bad_declarations_before_creating_anything(tmp_path, pool_name):
    loose = token_file(tmp_path, mode=0o644)
    for args, message in (
            (["--tenant", "a=uid"], "the proof must be"),
            (["--tenant", f"a=token:{loose}"], "mode 0644"),
            (["--tenant", "a=token:/nonexistent"], "cannot read the token file")):
        out = serve("--preset", "tiny", "--num-blocks", "64", "--name", pool_name,
                    "--socket", str(tmp_path / "s.sock"), *args)
        assert out.returncode == 2, out.stdout + out.stderr
        assert message in out.stderr and "Traceback" not in out.stderr
        assert not os.path.exists(f"/dev/shm/{pool_name}")


def test_the_config_file_serve_table(tmp_path):
    tok = token_file(tmp_path)
    path = tmp_path / "pool.toml"
    path.write_text(f"""
num_blocks = 64
hash_block_size = 4
max_model_len = 256

[[groups]]
type = "full"
block_size = 4

[serve]
tenant = ["a=token:{tok}"]
tenant_quota = ["a=10"]
""")
    assert PoolConfig.from_file(path).num_blocks == 64            # the pool ignores it                     # the pool ignores it
    assert serve_options(path) == {"tenant": [f"a=token:{tok}"], "tenant_quota": ["a=10"]}
    assert serve_options(None) == {"tenant": [], "tenant_quota": []}
    for table, message in (({"tenants": []}, "serve.tenants: unknown key"),
                           ({"tenant": "a=uid:1"}, "must be a list of strings"),
                           ({"tenant": [1]}, "must be a list of strings"),
                           ("x", "must be a table")):
        data = json.loads(CFG.to_json())
        data["serve"] = table
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(data))
        with pytest.raises(ConfigError, match=message):
            serve_options(bad)


def test_serve_takes_tenants_from_its_config_file(tmp_path, pool_name):
    loose = token_file(tmp_path, mode=0o644)
    data = json.loads(CFG.to_json())
    data["serve"] = {"tenant": [f"a=token:{loose}"]}
    path = tmp_path / "pool.json"
    path.write_text(json.dumps(data))
    out = serve("--config", str(path), "--name", pool_name, "--socket",
                str(tmp_path / "s.sock"))
    assert out.returncode == 2 and "mode 0644" in out.stderr, out.stderr


def test_peer_credentials_are_the_kernel_s(tmp_path):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = peer_credentials(a)
    assert (peer.pid, peer.uid) == (os.getpid(), ME)
    assert {os.getegid(), *os.getgroups()} <= peer.gids


def test_a_proven_session_resumes_after_a_coordinator_restart(tmp_path, pool_name):
    tok = token_file(tmp_path)
    with CoordinatorProcess(CFG, name=pool_name,
                            extra_args=("--tenant", f"a=token:{tok}")) as proc:
        with connect_sync(proc.socket, tenant="a", tenant_token="s3cret-token",
                          hash_algorithm=CFG.hash_algorithm, hash_seed=CFG.hash_seed,
                          reconnect=Reconnect(initial_delay=0.01, max_delay=0.1,
                                              timeout=20)) as c:
            c.add_request("x", tokens(0, 16))
            assert len(c.allocate_slots("x", 16)[0]) == 4
            proc.kill()
            proc.restart()
            assert len(c.get_block_ids("x")[0]) == 4       # resumed, proving itself again
        with pytest.raises(Forbidden):
            connect_sync(proc.socket, tenant="a", **kw())
        deadline = time.monotonic() + 10
        while "proves none of token:" not in proc.stderr and time.monotonic() < deadline:
            time.sleep(0.05)
        log = proc.stderr
        assert "FORBIDDEN: this session may not act as tenant 'a' (peer pid" in log
        assert "s3cret" not in log                        # the log names the file, never the token


def test_a_vllm_engine_proves_its_tenant_with_a_token_file(tmp_path, pool_name, monkeypatch):
    """The plugin's session (kvshm.vllm.binding, no vLLM needed to connect):
    KVSHM_TENANT names the tenant, KVSHM_TENANT_TOKEN_FILE proves it."""
    tok = token_file(tmp_path)
    with CoordinatorProcess(CFG, name=pool_name,
                            extra_args=("--tenant", f"a=token:{tok}")) as proc:
        monkeypatch.setenv("KVSHM_TENANT", "a")
        monkeypatch.setenv("KVSHM_CONNECT_TIMEOUT", "2")
        monkeypatch.delenv("KVSHM_TENANT_TOKEN_FILE", raising=False)
        with pytest.raises(Forbidden):
            PoolBinding(str(proc.socket)).connect()
        monkeypatch.setenv("KVSHM_TENANT_TOKEN_FILE", str(token_file(tmp_path, mode=0o644,
                                                                     name="loose")))
        with pytest.raises(ConfigError, match="mode 0644"):
            PoolBinding(str(proc.socket)).connect()
        monkeypatch.setenv("KVSHM_TENANT_TOKEN_FILE", str(tok))
        b = PoolBinding(str(proc.socket))
        try:
            assert b.connect().tenant == "a"
        finally:
            b.close()
