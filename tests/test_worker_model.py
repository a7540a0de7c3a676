"""workers/model.py: bit-exact K/V whatever the chunking or process; workers/attention.py:
arena I/O, paged attention against a plain reference, and block verification."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # workers/ is not an installed package
    sys.path.insert(0, str(ROOT))

from kvshm.pool.arena import resolve_dtype  # noqa: E402
from kvshm.workers import attention as wa  # noqa: E402
from kvshm.workers import model as wm  # noqa: E402
from kvshm.workers.attention import (  # noqa: E402
    attention,
    mismatching_blocks,
    paged_attention,
    read_kv,
    write_kv,
)
from kvshm.workers.model import Context, TinyModel  # noqa: E402

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes not installed")
DTYPES = [
    "float32",
    "float16",
    pytest.param("bfloat16", marks=needs_bf16),
]
GEOM = dict(num_layers=3, num_kv_heads=2, head_size=16)
MAXPOS = 4096


def make(dtype="float16", seed=0, **kw):
    args = dict(GEOM, dtype=dtype, seed=seed, max_positions=MAXPOS)
    args.update(kw)
    return TinyModel(**args)


def tokens(n, seed=0, high=50_000):
    return np.random.default_rng(seed + 1000).integers(0, high, n)


def kv_chunked(model, toks, sizes):
    """K/V of toks computed in chunks of the given sizes (cycled)."""
    ks, vs = [], []
    ctx = model.context([])
    pos, i = 0, 0
    while pos < len(toks):
        n = sizes[i % len(sizes)]
        k, v, ctx = model.kv(toks[pos : pos + n], pos, ctx)
        ks.append(k)
        vs.append(v)
        pos += k.shape[1]
        i += 1
    return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1), ctx


def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def arena_for(model, num_blocks, block_size, fill=0.0):
    shape = (num_blocks, model.num_layers, 2, block_size, model.num_kv_heads, model.head_size)
    return np.full(shape, fill, dtype=model.dtype)


# ------------------------------------------------------------------- dtypes


def test_resolve_dtype_names():
    assert resolve_dtype("float32") == np.float32
    assert resolve_dtype("float16") == np.float16
    if ml_dtypes is not None:
        assert resolve_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("name", ["float64", "fp16", "", "int8", "BFLOAT16"])
def test_resolve_dtype_unknown(name):
    with pytest.raises(ValueError, match="unknown KV dtype"):
        resolve_dtype(name)


def test_resolve_dtype_bfloat16_without_ml_dtypes(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)   # import ml_dtypes fails
    with pytest.raises(ValueError, match=r"bfloat16 KV arena needs the ml_dtypes package "
                                         r"\(pip install ml_dtypes\)"):
        resolve_dtype("bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_dtype_from_name_or_dtype(dtype):
    dt = resolve_dtype(dtype)
    assert make(dtype).dtype == dt
    assert make(dt).dtype == dt


@pytest.mark.parametrize("dtype", ["float64", np.float64, np.int16, "nope"])
def test_model_rejects_unsupported_dtype(dtype):
    with pytest.raises(ValueError):
        make(dtype)


@needs_bf16
def test_bfloat16_cast_rounds_once():
    """float64 -> bfloat16 is correctly rounded (ml_dtypes alone rounds twice)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(20_000) * 4
    ties = np.array([1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-30), 1 + 2**-8, 1 + 3 * 2**-8,
                     3 + 2**-6 + 2**-40, 0.0, -0.0])
    x = np.concatenate([x, ties])
    # reference: round the 53-bit significand to 8 bits, nearest-even, on the bits
    bits = x.view(np.uint64)
    keep, rem = bits >> np.uint64(45), bits & np.uint64((1 << 45) - 1)
    half = np.uint64(1 << 44)
    up = (rem > half) | ((rem == half) & ((keep & np.uint64(1)) == 1))
    expected = ((keep + up.astype(np.uint64)) << np.uint64(45)).view(np.float64)
    got = wm.round_to_dtype(x, np.dtype(ml_dtypes.bfloat16)).astype(np.float64)
    assert np.array_equal(got.view(np.uint64), expected.view(np.uint64))
    assert got[-7] == 1 + 2**-7  # above the tie: a double rounding would give 1.0


# --------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "name", ["num_layers", "num_kv_heads", "head_size", "d_model", "vocab", "max_positions"]
)
@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4", None])
def test_constructor_rejects_non_positive_ints(name, bad):
    with pytest.raises(ValueError, match=name):
        make(**{name: bad})


def test_constructor_rejects_odd_head_size_and_bad_seed():
    with pytest.raises(ValueError, match="head_size"):
        make(head_size=15)
    with pytest.raises(ValueError, match="seed"):
        make(seed=-1)
    with pytest.raises(ValueError, match="seed"):
        make(seed=1.5)


def test_kv_and_query_argument_errors():
    m = make()
    toks = tokens(10)
    ctx = m.context(toks[:4])
    with pytest.raises(ValueError, match="start=5"):
        m.kv(toks[5:], 5, ctx)  # ctx is after 4 tokens
    with pytest.raises(ValueError, match="start"):
        m.kv(toks, -1, m.context([]))
    with pytest.raises(ValueError, match="tokens"):
        m.kv(np.array([1.5, 2.0]), 0, m.context([]))
    with pytest.raises(ValueError, match="tokens"):
        m.kv(np.zeros((2, 2), dtype=int), 0, m.context([]))
    with pytest.raises(ValueError, match="ctx"):
        m.kv(toks, 0, None)
    with pytest.raises(ValueError, match="max_positions"):
        m.context(np.zeros(MAXPOS + 1, dtype=int))
    with pytest.raises(ValueError, match="pos=3"):
        m.query(toks[3], 3, ctx)  # ctx is after 4 tokens, the query needs 3
    with pytest.raises(ValueError, match="ctx"):
        make(d_model=32).kv(toks, 0, m.context([]))  # other model's context


# ----------------------------------------------------------------- exactness


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_kv_bit_identical_for_any_chunking(dtype, seed):
    m = make(dtype, seed)
    toks = tokens(300, seed)
    k, v, ctx = m.kv(toks, 0, m.context([]))
    assert k.dtype == v.dtype == m.dtype
    assert k.shape == v.shape == (3, 300, 2, 16)
    assert ctx == m.context(toks) and ctx.length == 300

    rng = np.random.default_rng(seed)
    chunkings = [
        [1],
        list(rng.integers(1, 40, 20)),
        [16],
        [7, 1, 100, 3],
        [299, 1],
    ]
    for sizes in chunkings:
        kc, vc, ctxc = kv_chunked(m, toks, sizes)
        assert kc.tobytes() == k.tobytes(), sizes
        assert vc.tobytes() == v.tobytes(), sizes
        assert ctxc == ctx

    # Continue after a prefix-cache hit: the context from the prefix alone.
    for n in (1, 63, 64, 65, 299):
        k2, v2, _ = m.kv(toks[n:], n, m.context(toks[:n]))
        assert k2.tobytes() == k[:, n:].tobytes()
        assert v2.tobytes() == v[:, n:].tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_seed_same_bits_other_seed_differs(dtype):
    toks = tokens(200)
    a, b, c = make(dtype, 5), make(dtype, 5), make(dtype, 6)
    ka, va, _ = a.kv(toks, 0, a.context([]))
    kb, vb, _ = b.kv(toks, 0, b.context([]))
    kc, vc, _ = c.kv(toks, 0, c.context([]))
    assert digest(ka, va) == digest(kb, vb)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    assert not np.array_equal(ka, kc) and not np.array_equal(va, vc)


def test_empty_chunk_is_a_no_op():
    m = make()
    toks = tokens(20)
    ctx = m.context(toks)
    k, v, ctx2 = m.kv([], 20, ctx)
    assert k.shape == v.shape == (3, 0, 2, 16)
    assert ctx2 == ctx


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_depends_on_the_whole_prefix(dtype):
    m = make(dtype)
    bs = 16
    block = tokens(bs, seed=1)
    prefixes = {
        "base": tokens(32, seed=2),
        "other": tokens(32, seed=3),
        "swapped": None,  # same multiset of tokens, two of them swapped
        "one_changed_at_6": None,  # a position whose weight is 0 mod 7 in a linear sum
        "shorter": tokens(16, seed=2),
    }
    base = prefixes["base"]
    swapped = base.copy()
    swapped[[3, 10]] = swapped[[10, 3]]
    prefixes["swapped"] = swapped
    changed = base.copy()
    changed[6] += 1
    prefixes["one_changed_at_6"] = changed
    assert base[3] != base[10]

    results = {}
    for name, pre in prefixes.items():
        k, v, _ = m.kv(block, len(pre), m.context(pre))
        results[name] = (k, v)
    names = list(results)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ka, va = results[a]
            kb, vb = results[b]
            # every single token of the block differs, in K and in V
            for t in range(bs):
                assert ka[:, t].tobytes() != kb[:, t].tobytes(), (a, b, t)
                assert va[:, t].tobytes() != vb[:, t].tobytes(), (a, b, t)


def test_same_token_differs_across_positions():
    m = make("float32")
    toks = np.full(64, 123)
    k, v, _ = m.kv(toks, 0, m.context([]))
    rows = {k[:, t].tobytes() for t in range(64)}
    assert len(rows) == 64


def test_token_ids_wrap_modulo_vocab():
    m = make(vocab=100)
    toks = tokens(30)
    k1, v1, _ = m.kv(toks, 0, m.context([]))
    k2, v2, _ = m.kv(toks % 100 + 300, 0, m.context([]))
    assert digest(k1, v1) == digest(k2, v2)


def test_values_in_a_sane_range():
    m = make("float32", d_model=64)
    k, v, _ = m.kv(tokens(2000), 0, m.context([]))
    for a in (k, v):
        assert np.isfinite(a).all()
        assert np.mean(np.abs(a) < 8) > 0.99
        assert 0.5 < np.std(a) < 4


def test_query_shape_and_consistency():
    m = make("bfloat16" if ml_dtypes is not None else "float16")
    toks = tokens(50)
    q = m.query(toks[49], 49, m.context(toks[:49]))
    assert q.shape == (3, 2, 16) and q.dtype == np.float32
    _, _, ctx = m.kv(toks[:49], 0, m.context([]))
    assert np.array_equal(m.query(int(toks[49]), 49, ctx), q)
    assert not np.array_equal(m.query(toks[49], 49, m.context(tokens(49, seed=9))), q)


def test_context_is_immutable_value():
    m = make()
    ctx = m.context(tokens(10))
    with pytest.raises(ValueError):
        ctx.state[0] = 1
    with pytest.raises(AttributeError):
        ctx.length = 3  # type: ignore[misc]
    assert ctx == m.context(tokens(10)) and ctx != m.context(tokens(11))
    assert isinstance(ctx, Context)


CHILD = textwrap.dedent(
    """
    import hashlib, sys
    import numpy as np
    from kvshm.workers.model import TinyModel
    dtype, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    m = TinyModel(num_layers=4, num_kv_heads=4, head_size=32, dtype=dtype, seed=seed,
                  d_model=256, max_positions=4096)
    toks = np.random.default_rng(seed + 1000).integers(0, 50_000, n)
    ks, vs = [], []
    ctx, pos, i = m.context([]), 0, 0
    while pos < n:  # chunked, unlike the parent's whole-prompt call
        size = [1, 37, 5, 256, 3][i % 5]
        k, v, ctx = m.kv(toks[pos : pos + size], pos, ctx)
        ks.append(k)
        vs.append(v)
        pos, i = pos + size, i + 1
    h = hashlib.sha256()
    for a in (np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)):
        h.update(np.ascontiguousarray(a).tobytes())
    print(h.hexdigest(), m.fingerprint())
    """
)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_process_bit_identical(dtype):
    seed, n = 11, 1500
    env = dict(os.environ)
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, dtype, str(seed), str(n)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    child_digest, child_fp = out.stdout.split()

    m = TinyModel(num_layers=4, num_kv_heads=4, head_size=32, dtype=dtype, seed=seed,
                  d_model=256, max_positions=4096)
    toks = tokens(n, seed)
    k, v, _ = m.kv(toks, 0, m.context([]))  # whole prompt, default BLAS threading
    assert child_fp == m.fingerprint()
    assert child_digest == digest(k, v)


# ----------------------------------------------------------------- arena I/O


def scrambled_table(num_blocks, n, seed=0):
    return [int(b) for b in np.random.default_rng(seed).permutation(np.arange(1, num_blocks))[:n]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start,n", [(0, 64), (5, 40), (13, 3), (16, 16), (3, 1), (0, 100)])
def test_write_read_round_trip(dtype, start, n):
    m = make(dtype)
    bs = 16
    toks = tokens(start + n)
    k, v, _ = m.kv(toks[start:], start, m.context(toks[:start]))
    arena = arena_for(m, 20, bs, fill=-7.0)
    table = scrambled_table(20, (start + n - 1) // bs + 1)
    write_kv(arena, table, bs, start, k, v)

    k2, v2 = read_kv(arena, table, bs, start, n)
    assert k2.dtype == m.dtype
    assert k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()

    # exactly the slots of the written tokens changed; nothing else
    written = np.zeros(arena.shape[:1] + arena.shape[3:4], dtype=bool)  # [block, slot]
    for pos in range(start, start + n):
        written[table[pos // bs], pos % bs] = True
    untouched = arena.transpose(0, 3, 1, 2, 4, 5)[~written]
    assert (untouched.astype(np.float32) == -7.0).all()
    assert mismatching_blocks(arena, table, bs, k, v, start=start) == []


def test_write_in_chunks_equals_write_at_once():
    m = make()
    bs = 8
    toks = tokens(77)
    table = scrambled_table(30, 10, seed=4)
    whole = arena_for(m, 30, bs)
    k, v, _ = m.kv(toks, 0, m.context([]))
    write_kv(whole, table, bs, 0, k, v)

    pieces = arena_for(m, 30, bs)
    ctx, pos = m.context([]), 0
    for size in [3, 5, 1, 20, 48]:
        kc, vc, ctx = m.kv(toks[pos : pos + size], pos, ctx)
        write_kv(pieces, table, bs, pos, kc, vc)
        pos += size
    assert whole.tobytes() == pieces.tobytes()


def test_arena_io_errors():
    m = make()
    bs = 16
    k, v, _ = m.kv(tokens(40), 0, m.context([]))
    arena = arena_for(m, 10, bs)
    with pytest.raises(ValueError, match="null block"):
        write_kv(arena, [1, 0, 2], bs, 0, k, v)
    with pytest.raises(ValueError, match="null block"):
        read_kv(arena, [1, 0, 2], bs, 0, 40)
    with pytest.raises(ValueError, match="block table has 2 entries"):
        write_kv(arena, [1, 2], bs, 0, k, v)
    with pytest.raises(ValueError, match="out of range"):
        write_kv(arena, [1, 2, 10], bs, 0, k, v)
    with pytest.raises(ValueError, match="block_size"):
        write_kv(arena, [1, 2, 3, 4, 5], 8, 0, k, v)
    with pytest.raises(ValueError, match="dtype"):
        write_kv(arena, [1, 2, 3], bs, 0, k.astype(np.float32), v.astype(np.float32))
    with pytest.raises(ValueError, match="k must be"):
        write_kv(arena, [1, 2, 3], bs, 0, k[:2], v[:2])
    with pytest.raises(ValueError, match="kv_arena"):
        write_kv(arena[0], [1, 2, 3], bs, 0, k, v)
    with pytest.raises(ValueError, match="start"):
        read_kv(arena, [1, 2, 3], bs, -1, 4)
    # a null block outside the range is fine (sliding window dropped it)
    write_kv(arena, [0, 0, 3], bs, 32, k[:, 32:], v[:, 32:])
    k2, _ = read_kv(arena, [0, 0, 3], bs, 32, 8)
    assert k2.tobytes() == k[:, 32:].tobytes()


# ------------------------------------------------------------- verification


@pytest.mark.parametrize("dtype", DTYPES)
def test_mismatching_blocks_finds_exactly_the_corrupted_block(dtype):
    m = make(dtype)
    bs = 16
    toks = tokens(90)
    k, v, _ = m.kv(toks, 0, m.context([]))
    arena = arena_for(m, 12, bs)
    table = scrambled_table(12, 6, seed=2)
    write_kv(arena, table, bs, 0, k, v)
    assert mismatching_blocks(arena, table, bs, k, v) == []

    bits = arena.view(np.dtype(f"u{arena.dtype.itemsize}"))
    for idx, (layer, kv_i, slot, head, dim) in [(3, (2, 1, 7, 1, 5)), (0, (0, 0, 0, 0, 0)),
                                                  (5, (1, 0, 9, 0, 15))]:
        bits[table[idx], layer, kv_i, slot, head, dim] ^= 1  # flip one bit of one element
        assert mismatching_blocks(arena, table, bs, k, v) == [idx]
        bits[table[idx], layer, kv_i, slot, head, dim] ^= 1
    assert mismatching_blocks(arena, table, bs, k, v) == []

    # a slot past the last token (block 5 holds tokens 80..89) is not compared
    arena[table[5], :, :, 12] = 99
    assert mismatching_blocks(arena, table, bs, k, v) == []
    # checking only a suffix ignores blocks before it
    arena[table[0]] = 0
    assert mismatching_blocks(arena, table, bs, k[:, 20:], v[:, 20:], start=20) == []
    assert mismatching_blocks(arena, table, bs, k, v) == [0]


def test_mismatching_blocks_compares_bits():
    m = make("float32")
    bs = 4
    k = np.zeros((3, 8, 2, 16), np.float32)
    v = np.full((3, 8, 2, 16), np.nan, np.float32)
    arena = arena_for(m, 4, bs)
    write_kv(arena, [1, 2], bs, 0, k, v)
    assert mismatching_blocks(arena, [1, 2], bs, k, v) == []  # NaN bits equal
    arena[2, 0, 0, 1, 0, 0] = -0.0
    assert mismatching_blocks(arena, [1, 2], bs, k, v) == [1]  # -0.0 != +0.0 bitwise


# ------------------------------------------------------------------ attention


def build(dtype, n, bs=16, seed=0, table_seed=0, extra_blocks=5):
    m = make(dtype, seed)
    toks = tokens(n + 1, seed)
    k, v, ctx = m.kv(toks[:n], 0, m.context([]))
    nblocks = (n - 1) // bs + 1
    arena = arena_for(m, nblocks + extra_blocks + 1, bs, fill=0.0)
    table = scrambled_table(nblocks + extra_blocks + 1, nblocks, seed=table_seed)
    write_kv(arena, table, bs, 0, k, v)
    q = m.query(toks[n], n, ctx)
    return m, arena, table, k, v, q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 513])
@pytest.mark.parametrize("tile_blocks", [1, 3, 16])
def test_paged_attention_matches_reference(dtype, n, tile_blocks):
    _, arena, table, k, v, q = build(dtype, n)
    ref = attention(q, k, v)
    out = paged_attention(q, arena, table, 16, n, tile_blocks=tile_blocks)
    assert out.shape == q.shape and out.dtype == np.float32
    # float32 math: outputs reach |8|, where one float32 ulp is ~1e-6
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,window", [(100, 1), (100, 16), (100, 17), (100, 40), (513, 128),
                                      (513, 129), (20, 64), (64, 64)])
def test_paged_attention_window_with_dropped_blocks(dtype, n, window):
    bs = 16
    _, arena, table, k, v, q = build(dtype, n, bs=bs)
    ref = attention(q, k, v, window=window)
    lo = max(0, n - window)
    assert np.allclose(ref, attention(q, k[:, lo:], v[:, lo:]), rtol=1e-6, atol=1e-7)
    # drop every block wholly before the window, as sliding-window managers do
    dropped = [0 if (b + 1) * bs <= lo else bid for b, bid in enumerate(table)]
    for tile_blocks in (1, 2, 16):
        out = paged_attention(q, arena, dropped, bs, n, window=window, tile_blocks=tile_blocks)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("n,window", [(100, None), (100, 40), (17, None)])
def test_paged_attention_reads_no_slot_outside_its_range(n, window):
    """Slots past the last token (not written yet) and before the window
    hold anything, NaN and inf included, without changing the result."""
    bs = 16
    _, arena, table, k, v, q = build("float32", n, bs=bs)
    refs = {t: paged_attention(q, arena, table, bs, n, window=window, tile_blocks=t)
            for t in (1, 3, 16)}
    last = table[(n - 1) // bs]
    arena[last, :, :, (n - 1) % bs + 1:] = np.nan            # the rest of the last block
    if window is not None:
        lo = n - window
        arena[table[lo // bs], :, :, :lo % bs] = np.inf        # before the window, same block
    for tile_blocks, ref in refs.items():
        out = paged_attention(q, arena, table, bs, n, window=window, tile_blocks=tile_blocks)
        np.testing.assert_array_equal(out, ref)


def test_paged_attention_null_block_inside_range_raises():
    bs = 16
    _, arena, table, k, v, q = build("float16", 100, bs=bs)
    bad = list(table)
    bad[3] = 0  # tokens 48..63
    with pytest.raises(ValueError, match="null block"):
        paged_attention(q, arena, bad, bs, 100)
    with pytest.raises(ValueError, match="null block"):
        paged_attention(q, arena, bad, bs, 100, window=60)  # window starts at 40
    # window starting at 64 no longer touches entry 3
    out = paged_attention(q, arena, bad, bs, 100, window=36)
    np.testing.assert_allclose(out, attention(q, k, v, window=36), rtol=1e-5, atol=2e-6)


def test_paged_attention_argument_errors():
    bs = 16
    _, arena, table, k, v, q = build("float16", 40, bs=bs)
    with pytest.raises(ValueError, match="num_tokens"):
        paged_attention(q, arena, table, bs, 0)
    with pytest.raises(ValueError, match="window"):
        paged_attention(q, arena, table, bs, 40, window=0)
    with pytest.raises(ValueError, match="block table has 3 entries"):
        paged_attention(q, arena, table, bs, 49)
    with pytest.raises(ValueError, match="q must be"):
        paged_attention(q[:1], arena, table, bs, 40)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention(q, arena, table, 8, 40)
    with pytest.raises(ValueError, match="out of range"):
        paged_attention(q, arena, [1, 2, 99], bs, 40)
    with pytest.raises(ValueError, match="tile_blocks"):
        paged_attention(q, arena, table, bs, 40, tile_blocks=0)
    with pytest.raises(ValueError, match="zero tokens"):
        attention(q, k[:, :0], v[:, :0])


def test_half_widening_is_exact_for_every_bit_pattern():
    """The fast float16 -> float32 path equals numpy's cast on all 65536 halves,
    and inf/NaN (not handled by the bit trick) fall back to numpy's cast."""
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = patterns[(patterns & 0x7C00) != 0x7C00]
    for values in (finite, patterns):
        arena = values.view(np.float16).reshape(-1, 1, 2, 8, 2, 4)  # [nb, L, 2, bs, H, D]
        tile = np.arange(arena.shape[0])
        out = np.empty((2, 1, tile.size, 8, 2, 4), dtype=np.float32)
        wa.widen_blocks(arena, tile, out)
        expected = arena.transpose(2, 1, 0, 3, 4, 5).astype(np.float32)
        assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))
