"""Several users on one pool (`kvshm serve --group G`): the socket, its
directory, the segments and the arena are opened to group G and no further,
the admin token stays the coordinator's, adoption keeps the modes, and two
real uids in G share one prefix cache and its K/V bytes while a third uid is
refused by the OS.

The cross-uid test makes throwaway users and a group (it needs root, as CI
runs; elsewhere it is skipped, saying so).  Each client is a child forked
from this process that drops to its user before connecting: this Python's
files may not be readable by other users, so everything it needs is
imported before the fork."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

from helpers import make_config, tokens
from kvshm.core.specs import KVShape
from kvshm.ops.errors import Forbidden
from kvshm.pool.arena import arena_name
from kvshm.pool.lifecycle import adopt_pool, create_pool
from kvshm.pool.segment import SHM_DIR
from kvshm.service.handshake import admin_token_path
from kvshm.service.process import CoordinatorProcess
from kvshm.service.sync_client import connect_sync

CFG = make_config(num_blocks=64, max_num_seqs=16,
                  kv=KVShape(num_layers=1, num_kv_heads=1, head_size=8, dtype="float32"))
PROMPT = tokens(0, 16)     # 4 full blocks


def mode_and_group(path) -> tuple[int, int]:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_gid


def test_adoption_keeps_the_modes_a_group_gave(pool_name):
    gid = os.getegid()
    pool = create_pool(CFG, pool_name, group=gid)
    try:
        for n in (pool_name, arena_name(pool_name)):
            assert mode_and_group(f"{SHM_DIR}/{n}") == (0o660, gid)
    finally:
        pool.close(unlink=False)          # as a killed coordinator leaves it
    pool = adopt_pool(CFG, pool_name)     # adopted without --group: the modes stay
    try:
        for n in (pool_name, arena_name(pool_name)):
            assert mode_and_group(f"{SHM_DIR}/{n}") == (0o660, gid)
    finally:
        pool.close()
    pool = create_pool(CFG, pool_name)    # and without a group, 0600
    try:
        assert mode_and_group(f"{SHM_DIR}/{pool_name}")[0] == 0o600
    finally:
        pool.close()


def test_serve_refuses_an_unknown_group(pool_name, tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvshm", "serve", "--preset", "tiny",
                          "--num-blocks", "64", "--name", pool_name, "--socket",
                          str(tmp_path / "s.sock"), "--group", "no-such-group-kvshm"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "no group named 'no-such-group-kvshm'" in out.stderr
    assert not os.path.exists(f"{SHM_DIR}/{pool_name}")


# -- two real users ----------------------------------------------------------------------
@pytest.fixture
def users():
    """A throwaway group with two member users and one outsider:
    {"gid": G, "a": (uid, gid), "b": ..., "outsider": ...}."""
    if os.geteuid() != 0:
        pytest.skip("making throwaway users needs root (CI runs the tests as root)")
    if not (shutil.which("groupadd") and shutil.which("useradd")):
        pytest.skip("groupadd/useradd are not installed")
    tag = secrets.token_hex(3)
    group = f"kvshm-g{tag}"
    names = {k: f"kvshm-{k[0]}{tag}" for k in ("a", "b", "outsider")}
    made_users = []
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    try:
        for key, name in names.items():
            extra = [] if key == "outsider" else ["-G", group]
            subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", *extra, name],
                           check=True, capture_output=True)
            made_users.append(name)
        import grp
        import pwd
        out = {"group": group, "gid": grp.getgrnam(group).gr_gid}
        for key, name in names.items():
            pw = pwd.getpwnam(name)
            groups = [] if key == "outsider" else [out["gid"]]
            out[key] = (pw.pw_uid, pw.pw_gid, groups)
        yield out
    finally:
        for name in made_users:
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def _as_user(conn, who, fn, *args):
    """In a forked child: become `who` (uid, gid, groups), run fn, send back
    what it returned or the exception's type and text."""
    uid, gid, groups = who
    try:
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)
        conn.send(("ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(e).__name__}: {e}"))


def run_as(who, fn, *args):
    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_as_user, args=(theirs, who, fn, *args))
    child.start()
    ok = mine.poll(60)
    result = mine.recv() if ok else ("error", "no answer within 60 s")
    child.join(10)
    return result


def write_prefix(sock):
    """User a: a request computes PROMPT, writes its K/V (the block id in
    every element) and caches its blocks."""
    with connect_sync(sock, hash_algorithm=CFG.hash_algorithm, hash_seed=CFG.hash_seed,
                      resume=False) as c:
        arena = c.attach_arena()
        try:
            c.add_request("a", PROMPT)
            blocks = c.allocate_slots("a", len(PROMPT))[0]
            for b in blocks:
                arena.kv[b] = b
            c.advance("a", len(PROMPT))
            c.cache_blocks("a", len(PROMPT))
        finally:
            arena.close()
        return os.getuid(), list(blocks)


def read_prefix(sock):
    """User b: the same prompt hits a's blocks, whose K/V it reads."""
    with connect_sync(sock, hash_algorithm=CFG.hash_algorithm, hash_seed=CFG.hash_seed,
                      resume=False) as c:
        c.add_request("b", PROMPT + [7])
        hits, n = c.get_computed_blocks("b")
        arena = c.attach_arena()
        try:
            data = [float(np.asarray(arena.kv[b]).mean()) for b in hits[0]]
        finally:
            arena.close()
        c.allocate_slots("b", len(PROMPT) + 1 - n, n, use_computed_blocks=True)
        return os.getuid(), list(hits[0]), n, data


def outsider(sock, segment):
    out = {}
    try:
        connect_sync(sock, resume=False)
        out["connect"] = "connected"
    except Forbidden as e:
        out["connect"] = f"Forbidden: {e}"
    try:
        open(f"{SHM_DIR}/{segment}", "rb").close()
        out["segment"] = "opened"
    except PermissionError as e:
        out["segment"] = f"PermissionError: {e.strerror}"
    return out


def test_two_uids_share_one_pool_and_a_third_is_refused(users, pool_name):
    gid = users["gid"]
    with CoordinatorProcess(CFG, name=pool_name, extra_args=("--group", users["group"])) as proc:
        sock = proc.socket
        assert mode_and_group(sock) == (0o660, gid)
        assert mode_and_group(sock.parent) == (0o750, gid)
        for n in (pool_name, arena_name(pool_name)):
            assert mode_and_group(f"{SHM_DIR}/{n}") == (0o660, gid)
        token = admin_token_path(sock)
        assert mode_and_group(token)[0] == 0o600 and os.stat(token).st_uid == os.getuid()

        status, got = run_as(users["a"], write_prefix, sock)
        assert status == "ok", got
        uid_a, blocks = got
        status, got = run_as(users["b"], read_prefix, sock)
        assert status == "ok", got
        uid_b, hits, n, data = got
        assert uid_a != uid_b and uid_a == users["a"][0]
        assert hits == blocks and n == len(PROMPT)           # b hit a's prefix
        assert data == [float(b) for b in blocks]            # and read a's K/V bytes

        status, got = run_as(users["outsider"], outsider, sock, pool_name)
        assert status == "ok", got
        assert got["connect"].startswith("Forbidden: connecting to") and \
            "Permission denied" in got["connect"], got
        assert got["segment"] == "PermissionError: Permission denied"

        proc.kill()                                          # adoption keeps the modes
        proc.restart()
        for path in (sock, f"{SHM_DIR}/{pool_name}", f"{SHM_DIR}/{arena_name(pool_name)}"):
            assert mode_and_group(path) == (0o660, gid), path
        status, got = run_as(users["b"], read_prefix, sock)
        assert status == "ok" and got[2] == len(PROMPT), got   # the cache survived too
