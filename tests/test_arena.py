"""The KV data arena: its config, layout, mapping from several processes,
lifecycle with the coordinator, and the Admit operation workers use."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import fully_allocated, make_config, tokens
from kvshm.core.check import check_segment
from kvshm.core.errors import ConfigError, SegmentError, ShmSpaceError
from kvshm.core.specs import FullSpec, KVShape, PoolConfig, SlidingWindowSpec
from kvshm.ops.errors import InvalidArgument, UnknownRequest
from kvshm.pool.arena import ArenaLayout, KVArena, arena_bytes, arena_name, resolve_dtype
from kvshm.pool.lifecycle import adopt_pool, create_pool, remove_pool
from kvshm.pool.segment import SHM_DIR, list_segments, remove_segment
from kvshm.service.client import connect
from kvshm.service.process import CoordinatorProcess

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32")


def kv_config(**changes):
    changes.setdefault("kv", SHAPE)
    return make_config(num_blocks=changes.pop("num_blocks", 16), **changes)


@pytest.fixture
def coordinator_config():
    return kv_config(num_blocks=12, max_num_seqs=8)


def _name(tag: str) -> str:
    return f"kvshm-test-{tag}-{os.getpid()}.kv"


# -- config ---------------------------------------------------------------------------------
def test_kv_shape_sizes_the_block():
    cfg = kv_config()
    # K and V x 2 layers x 4 tokens x 2 heads x 8 dims x 4 bytes
    assert cfg.kv_block_bytes == 2 * 2 * 4 * 2 * 8 * 4
    lay = ArenaLayout(cfg)
    assert lay.shape == (16, 2, 2, 4, 2, 8)
    assert lay.data_offset % 4096 == 0 and lay.size == lay.data_offset + 16 * cfg.kv_block_bytes
    hybrid = make_config((FullSpec(4), SlidingWindowSpec(8, 16)), kv=SHAPE)
    assert hybrid.kv_block_size == 8   # block ids are shared: the largest group block
    assert make_config().kv_block_bytes == 0 and arena_bytes(make_config()) == 0


@pytest.mark.parametrize("field,value,message", [
    ("num_layers", 0, "kv.num_layers: must be a positive integer"),
    ("num_kv_heads", -1, "kv.num_kv_heads: must be a positive integer"),
    ("head_size", 0, "kv.head_size: must be a positive integer"),
    ("dtype", "int8", "kv.dtype: must be one of float32, float16, bfloat16"),
])
def test_bad_kv_shapes_are_refused(field, value, message):
    shape = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "dtype": "float16",
             field: value}
    with pytest.raises(ConfigError, match=message):
        make_config(kv=KVShape(**shape))


def test_kv_shape_loads_from_a_config_file(tmp_path):
    path = tmp_path / "pool.toml"
    path.write_text('num_blocks = 8\nhash_block_size = 4\nmax_model_len = 64\n'
                    'groups = [{type = "full", block_size = 4}]\n'
                    '[kv]\nnum_layers = 3\nnum_kv_heads = 1\nhead_size = 16\n')
    cfg = PoolConfig.from_file(path)
    assert cfg.kv == KVShape(num_layers=3, num_kv_heads=1, head_size=16, dtype="float16")
    path.write_text(path.read_text().replace("head_size = 16", 'head_size = "big"'))
    with pytest.raises(ConfigError, match="kv.head_size"):
        PoolConfig.from_file(path)


def test_resolve_dtype():
    assert resolve_dtype("float16") == np.float16 and resolve_dtype("float32") == np.float32
    pytest.importorskip("ml_dtypes")
    assert resolve_dtype("bfloat16").name == "bfloat16"
    with pytest.raises(ConfigError, match="unknown KV dtype 'int4'"):
        resolve_dtype("int4")


# -- the segment ---------------------------------------------------------------------------
def test_create_attach_share_and_unlink():
    cfg = kv_config()
    name = _name("share")
    with KVArena.create(cfg, name) as owner:
        assert owner.kv.shape == (16, 2, 2, 4, 2, 8) and owner.kv.dtype == np.float32
        assert not owner.kv.any() and not owner.writer.any()
        other = KVArena.attach(name, cfg)
        owner.kv[3, 1, 0, 2] = 7.5
        owner.writer[3] = 9
        assert other.kv[3, 1, 0, 2, 1, 4] == 7.5 and other.writer[3] == 9
        with pytest.raises(SegmentError, match="only the process that created"):
            other.unlink()
        other.close()
        other.close()   # idempotent
        info = {s["name"]: s for s in list_segments()}[name]
        assert info["kind"] == "arena" and info["pid"] == os.getpid() and info["alive"]
    assert not os.path.exists(f"{SHM_DIR}/{name}")


def test_close_refuses_while_views_live():
    cfg = kv_config()
    with KVArena.create(cfg, _name("views")) as arena:
        view = arena.kv[1]
        with pytest.raises(SegmentError, match="views of its data are still alive"):
            arena.close()
        del view
    # __exit__ closed and unlinked it once the view was gone


def test_attach_errors():
    cfg = kv_config()
    with pytest.raises(SegmentError, match="no KV arena segment named"):
        KVArena.attach("kvshm-test-none.kv", cfg)
    with KVArena.create(cfg, _name("errs")) as arena:
        with pytest.raises(SegmentError, match="made for another pool config"):
            KVArena.attach(arena.name, kv_config(num_blocks=17))
    from kvshm import KVCacheManager
    with KVCacheManager(cfg, name=f"kvshm-test-pool-{os.getpid()}") as mgr:
        with pytest.raises(SegmentError, match="is not a kvshm KV arena"):
            KVArena.attach(mgr.segment.name, cfg)


def test_create_errors(monkeypatch):
    cfg = kv_config()
    with pytest.raises(SegmentError, match="arena name 'bad/name'"):
        KVArena.create(cfg, "bad/name")
    with pytest.raises(SegmentError, match="no `kv` shape"):
        KVArena.create(make_config(), _name("noshape"))
    with KVArena.create(cfg, _name("dup")):
        with pytest.raises(SegmentError, match="already exists"):
            KVArena.create(cfg, _name("dup"))
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 20, 1 << 20, 4096))
    with pytest.raises(ShmSpaceError, match="--kv-memory"):
        KVArena.create(cfg, _name("small"))
    assert not os.path.exists(f"{SHM_DIR}/{_name('small')}")


_CHILD = """
import sys
import numpy as np
from kvshm.core.specs import PoolConfig
from kvshm.pool.arena import KVArena
cfg = PoolConfig.from_json(sys.argv[2].encode())
arena = KVArena.attach(sys.argv[1], cfg)
block, value = int(sys.argv[3]), float(sys.argv[4])
seen = float(arena.kv[1].sum())         # what the parent wrote
arena.kv[block] = value
arena.writer[block] = block
print(seen)
"""


def test_several_processes_map_one_arena():
    cfg = kv_config()
    with KVArena.create(cfg, _name("procs")) as arena:
        arena.kv[1] = 0.5
        procs = [subprocess.run([sys.executable, "-c", _CHILD, arena.name,
                                 cfg.to_json().decode(), str(b), str(b * 1.5)],
                                capture_output=True, text=True, timeout=60)
                 for b in (2, 3, 4)]
        for res in procs:
            assert res.returncode == 0, res.stderr
            assert float(res.stdout) == 0.5 * arena.kv[1].size
        for b in (2, 3, 4):
            assert (arena.kv[b] == b * 1.5).all() and arena.writer[b] == b
        assert not arena.kv[5].any()


def test_rm_removes_a_dead_coordinators_arena():
    cfg = kv_config()
    name = _name("stale")
    res = subprocess.run([sys.executable, "-c",
                          "import sys; from kvshm.pool.arena import KVArena; "
                          "from kvshm.core.specs import PoolConfig; "
                          "KVArena.create(PoolConfig.from_json(sys.argv[1].encode()), sys.argv[2])",
                          cfg.to_json().decode(), name], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    info = {s["name"]: s for s in list_segments()}[name]
    assert info["kind"] == "arena" and not info["alive"]
    remove_segment(name)
    assert not os.path.exists(f"{SHM_DIR}/{name}")


# -- with the coordinator ---------------------------------------------------------------------
async def _client(coord):
    return await connect(coord.socket_path)


async def test_coordinator_creates_names_and_unlinks_the_arena(coordinator):
    coord = await coordinator()
    assert coord.arena is not None and coord.arena.name == arena_name(coord.name)
    path = f"{SHM_DIR}/{coord.arena.name}"
    assert os.path.exists(path)
    c = await _client(coord)
    assert c.arena_segment == coord.arena.name
    arena = c.attach_arena()
    arena.kv[2] = 1.0
    assert coord.arena.kv[2].all()
    arena.close()
    await c.close()
    await coord.stop()
    assert not os.path.exists(path)


async def test_a_pool_without_kv_shape_has_no_arena(coordinator):
    coord = await coordinator(make_config(num_blocks=12))
    c = await _client(coord)
    assert coord.arena is None and c.arena_segment == ""
    with pytest.raises(SegmentError, match="has no KV arena"):
        c.attach_arena()
    await c.close()


async def test_coordinator_refuses_an_arena_dev_shm_cannot_hold(coordinator, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    from kvshm.pool.layout import Layout
    cfg = kv_config(num_blocks=4096)
    free = Layout(cfg).size + 4096   # room for the pool segment alone, not the arena too
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 0, free))
    before = set(os.listdir(SHM_DIR))
    needed = Layout(cfg).size + arena_bytes(cfg)
    with pytest.raises(ShmSpaceError, match=f"needs {needed:,} bytes .* has only {free:,} free"):
        await coordinator(cfg)
    assert set(os.listdir(SHM_DIR)) == before


def test_a_new_pool_s_pages_are_allocated_unless_the_arena_is_left_to_first_touch():
    cfg = kv_config(num_blocks=256)
    for reserve in (True, False):
        name = f"kvshm-test-reserve-{reserve}-{os.getpid()}"
        pool = create_pool(cfg, name, reserve_arena=reserve)
        try:
            assert fully_allocated(pool.mgr.segment.name)       # the state: always
            assert fully_allocated(pool.arena.name) is reserve
        finally:
            pool.close()


@pytest.mark.parametrize("flags,reserved", [((), True), (("--no-reserve-arena",), False)])
def test_kvshm_serve_allocates_the_arena_unless_told_not_to(flags, reserved):
    cfg = kv_config(num_blocks=256)
    with CoordinatorProcess(cfg, extra_args=flags) as proc:   # (ready)
        assert fully_allocated(arena_name(proc.name)) is reserved
        assert fully_allocated(proc.name)                           # the state: always


def test_adoption_allocates_the_pages_a_sparse_pool_lacks(monkeypatch):
    cfg = kv_config(num_blocks=256)
    name = f"kvshm-test-adopt-sparse-{os.getpid()}"
    create_pool(cfg, name, reserve_arena=False).close(unlink=False)   # a dead coordinator's
    path = f"{SHM_DIR}/{arena_name(name)}"
    assert not fully_allocated(arena_name(name))
    try:
        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(os, "posix_fallocate", full)
        pool = adopt_pool(cfg, name)              # /dev/shm too full now: adopted, and said
        assert [n for n in pool.adoption.notes if arena_name(name) in n
                and "not allocated" in n and "SIGBUS" in n]
        pool.close(unlink=False)
        monkeypatch.undo()
        pool = adopt_pool(cfg, name, reserve_arena=False)   # left to first touch, as asked
        assert not fully_allocated(arena_name(name)) and not pool.adoption.notes
        pool.close(unlink=False)
        pool = adopt_pool(cfg, name)
        assert fully_allocated(arena_name(name)) and not pool.adoption.notes
        assert check_segment(pool.mgr.segment, pool.mgr.block_pool).clean
        pool.close()
    except BaseException:
        remove_pool(name, force=True)
        raise
    assert not os.path.exists(path)


_FILL_THEN_WRITE = """
import os, sys
import numpy as np
from kvshm.core.specs import KVShape
from kvshm.pool.lifecycle import create_pool
sys.path.insert(0, {tests!r})
from helpers import make_config
cfg = make_config(num_blocks=256, kv=KVShape(num_layers=2, num_kv_heads=2, head_size=64,
                                             dtype="float32"))
pool = create_pool(cfg, "kvshm-fill", reserve_arena={reserve})
with open("/dev/shm/filler", "wb", buffering=0) as f:   # another program fills /dev/shm
    try:
        while True:
            f.write(bytes(1 << 16))
    except OSError:
        pass
view = np.frombuffer(pool.arena.buffer, dtype=np.uint8)
view[len(view) // 2:] = 1      # an engine writes K/V into pages never touched
del view
pool.close()
print("written")
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs a private /dev/shm (unshare -m, as root)")
@pytest.mark.parametrize("reserve", [True, False])
def test_a_dev_shm_filled_after_the_pool_was_made_cannot_kill_a_writer(reserve):
    code = _FILL_THEN_WRITE.format(tests=os.path.dirname(__file__), reserve=reserve)
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=16m tmpfs /dev/shm && '
         'exec "$0" -c "$1"', sys.executable, code],
        capture_output=True, text=True, timeout=60)
    if reserve:
        assert proc.returncode == 0 and "written" in proc.stdout, proc.stderr
    else:   # the risk --no-reserve-arena takes back: the writer dies of SIGBUS
        assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr)


async def test_admit_is_lookup_plus_allocate_in_one_step(coordinator):
    coord = await coordinator()
    c = await _client(coord)
    prompt = tokens(0, 14)   # 3 full blocks of 4 + 2 tokens
    await c.add_request("a", prompt)
    first = await c.admit("a", 100, delay_cache_blocks=True)
    assert (first.num_computed_tokens, first.num_new_tokens) == (0, 14)
    assert first.hit_block_ids == [[]] and len(first.new_block_ids[0]) == 4
    await c.advance("a", 14)
    await c.cache_blocks("a", 14)           # the delayed caching, after "compute"
    await c.free("a")
    await c.add_request("b", prompt + [99])
    second = await c.admit("b", 2)
    assert second.num_computed_tokens == 12 and second.num_new_tokens == 2
    assert second.hit_block_ids == [first.new_block_ids[0][:3]]
    assert await c.get_block_ids("b") == [second.hit_block_ids[0] + second.new_block_ids[0]]
    await c.close()


async def test_admit_when_the_pool_is_short_changes_nothing(coordinator):
    coord = await coordinator()
    c = await _client(coord)
    await c.add_request("big", tokens(0, 60))
    free = coord.mgr.block_pool.num_free_blocks
    res = await c.admit("big", 60)
    assert res.new_block_ids is None and res.num_free_blocks == free
    assert await c.get_block_ids("big") == [[]]
    await c.close()


async def test_admit_errors(coordinator):
    coord = await coordinator()
    c = await _client(coord)
    with pytest.raises(UnknownRequest):
        await c.admit("nobody", 4)
    await c.add_request("r", tokens(0, 10))
    with pytest.raises(InvalidArgument, match=r"max_new_tokens must be in \[1, "):
        await c.admit("r", 0)
    with pytest.raises(InvalidArgument, match="num_lookahead_tokens must be in"):
        await c.admit("r", 4, num_lookahead_tokens=-1)
    await c.admit("r", 10)
    await c.advance("r", 10)
    free = coord.mgr.block_pool.num_free_blocks
    with pytest.raises(InvalidArgument, match="already has 10 computed tokens"):
        await c.admit("r", 4)
    assert coord.mgr.block_pool.num_free_blocks == free
    await c.close()


def test_kvshm_ls_and_rm_know_arenas(capsys):
    from kvshm.cli import main
    cfg = kv_config()
    with KVArena.create(cfg, _name("cli")) as arena:
        assert main(["ls"]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines()
                    if ln.startswith(arena.name))
        assert f"KV arena, {arena.layout.size:,} bytes, 16 blocks" in line and "live" in line
        assert main(["rm", arena.name]) == 2
        assert "live process" in capsys.readouterr().err
        assert os.path.exists(f"{SHM_DIR}/{arena.name}")
