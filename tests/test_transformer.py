"""The transformer model (workers/transformer.py): a real decoder stack whose
K/V agree, within TOLERANCE, however the tokens were chunked or batched,
and whose hit check catches a corrupted block (the engine side is in
tests/test_workers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvshm.workers.attention import write_kv
from kvshm.workers.transformer import TOLERANCE, TransformerModel, mismatching_blocks_within


def model(dtype="float32", **kw) -> TransformerModel:
    return TransformerModel(num_layers=2, num_kv_heads=2, head_size=16, dtype=dtype, seed=3,
                            **kw)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float32), b.astype(np.float32)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_shapes_cost_and_fingerprint():
    m = model()
    k, v, h = m.forward(list(range(10)), 0)
    assert k.shape == v.shape == (2, 10, 2, 16) and k.dtype == np.float32
    assert h.shape == (10, m.hidden) and m.hidden == 4 * 16      # 2 query heads per KV head
    # per layer: QKV (64 x 128), output (64 x 64), gate+up (64 x 384), down (192 x 64)
    assert m.parameters == 2 * (64 * 128 + 64 * 64 + 64 * 384 + 192 * 64)
    assert m.fingerprint() == model().fingerprint() != TransformerModel(
        num_layers=2, num_kv_heads=2, head_size=16, dtype="float32", seed=4).fingerprint()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_chunked_prefill_agrees_within_the_tolerance(dtype):
    m = model(dtype)
    toks = list(range(500, 700))
    k, v, h = m.forward(toks, 0)
    k1, v1, _ = m.forward(toks[:77], 0)
    k2, v2, h2 = m.forward(toks[77:], 77, k1, v1)
    assert rel_err(np.concatenate([k1, k2], axis=1), k) < TOLERANCE / 10
    assert rel_err(np.concatenate([v1, v2], axis=1), v) < TOLERANCE / 10
    assert rel_err(h2, h[77:]) < TOLERANCE / 10


def test_a_batch_agrees_with_its_segments():
    m = model()
    a, b = list(range(40)), list(range(100, 130))
    ka, va, _ = m.forward(a, 0)
    kb, vb, hb = m.forward(b[:20], 0)
    [(k1, v1, _), (k2, v2, h2)] = m.forward_batch([(a, 0, None, None),
                                                   (b[20:], 20, kb, vb)])
    assert rel_err(k1, ka) < 1e-5
    _, _, hb_all = m.forward(b, 0)
    assert rel_err(h2, hb_all[20:]) < TOLERANCE / 10


def paged(m, seqs, block_size=4, num_blocks=64, seed=0):
    """An arena holding each sequence's K/V in shuffled blocks (the rest
    random), and the block tables."""
    rng = np.random.default_rng(seed)
    view = rng.standard_normal((num_blocks, m.num_layers, 2, block_size, m.num_kv_heads,
                                m.head_size)).astype(m.dtype)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = []
    for toks in seqs:
        table = [int(free.pop()) for _ in range(-(-len(toks) // block_size))]
        if toks:
            k, v, _ = m.forward(toks, 0)
            write_kv(view, table, block_size, 0, k, v)
        tables.append(table)
    return view, tables


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_paged_decode_agrees_with_a_contiguous_forward(dtype):
    m = model(dtype)
    # Contexts of several lengths (partial last blocks, one of none at all),
    # each request's next token at its position.
    seqs = [list(range(s, s + n)) for s, n in ((10, 37), (300, 4), (50, 0), (7, 21), (900, 1))]
    view, tables = paged(m, seqs)
    nxt = [3, 4, 5, 6, 7]
    k, v, h = m.decode(nxt, [len(t) for t in seqs], view, tables)
    assert k.shape == v.shape == (2, 5, 2, 16) and k.dtype == m.dtype and h.shape == (5, m.hidden)
    for i, toks in enumerate(seqs):
        k_ref, v_ref, h_ref = m.forward(toks + [nxt[i]], 0)
        assert rel_err(k[:, i], k_ref[:, -1]) < TOLERANCE / 10
        assert rel_err(v[:, i], v_ref[:, -1]) < TOLERANCE / 10
        assert rel_err(h[i], h_ref[-1]) < TOLERANCE / 10
    # The context is read from the blocks: another block's bytes change it.
    other = view.copy()
    other[tables[0][0]] = other[tables[3][0]]
    _, _, h_other = m.decode(nxt, [len(t) for t in seqs], other, tables)
    assert rel_err(h_other[0], h[0]) > TOLERANCE and np.array_equal(h_other[1:], h[1:])


def test_paged_decode_refuses_what_does_not_fit():
    m = model()
    view, tables = paged(m, [list(range(9))])
    with pytest.raises(ValueError, match="3 blocks hold fewer than its 13 tokens"):
        m.decode([1], [13], view, tables)
    with pytest.raises(ValueError, match="one of each per request"):
        m.decode([1, 2], [9], view, tables)
    with pytest.raises(ValueError, match="position must be"):
        m.decode([1], [-1], view, tables)
    with pytest.raises(ValueError, match="arena view must be"):
        m.decode([1], [9], view[:, :1], tables)
    assert m.decode([], [], view, [])[2].shape == (0, m.hidden)


def test_tokens_attend_causally():
    m = model()
    _, _, h = m.forward([1, 2, 3, 4], 0)
    _, _, h_other = m.forward([1, 2, 3, 9], 0)      # only the last token differs
    assert np.array_equal(h[:3], h_other[:3]) and not np.allclose(h[3], h_other[3])


def test_the_earlier_tokens_k_v_are_required():
    with pytest.raises(ValueError, match="K/V of the 5 earlier tokens"):
        model().forward([1], 5)


def test_mismatching_blocks_within_the_tolerance():
    bs = 4
    arena = np.zeros((3, 2, 2, bs, 2, 16), dtype=np.float16)    # [blocks, L, K|V, slot, H, D]
    m = model("float16")
    k, v, _ = m.forward(list(range(8)), 0)
    for i, block in enumerate((1, 2)):
        arena[block, :, 0] = k[:, i * bs:(i + 1) * bs]
        arena[block, :, 1] = v[:, i * bs:(i + 1) * bs]
    k2, v2, _ = m.forward(list(range(4)), 0)        # chunked differently: rounding only
    k2b, v2b, _ = m.forward(list(range(4, 8)), 4, k2, v2)
    want_k, want_v = np.concatenate([k2, k2b], 1), np.concatenate([v2, v2b], 1)
    assert mismatching_blocks_within(arena, [1, 2], bs, want_k, want_v) == []
    arena[2, 1, 1, 3, 0, 5] += 1.0                  # one V element of block 2
    assert mismatching_blocks_within(arena, [1, 2], bs, want_k, want_v) == [1]


def test_a_step_runs_prefill_chunks_and_decode_tokens_in_one_pass():
    """`step` is `forward_batch` of the segments and `decode` of the decode
    tokens, in one pass (the engine's fused step), within float32 rounding."""
    m = model()
    seqs = [list(range(10, 47)), list(range(300, 305))]
    view, tables = paged(m, seqs)
    prompt = list(range(500, 530))
    k0, v0, _ = m.forward(prompt[:12], 0)
    segments = [(prompt[12:], 12, k0, v0), (list(range(60, 69)), 0, None, None)]
    outs, (k, v, h) = m.step(segments, ([1, 2], [len(t) for t in seqs], view, tables))
    for (ko, vo, ho), (kr, vr, hr) in zip(outs, m.forward_batch(segments)):
        assert rel_err(ko, kr) < TOLERANCE / 10 and rel_err(vo, vr) < TOLERANCE / 10
        assert rel_err(ho, hr) < TOLERANCE / 10
    kd, vd, hd = m.decode([1, 2], [len(t) for t in seqs], view, tables)
    assert rel_err(k, kd) < TOLERANCE / 10 and rel_err(h, hd) < TOLERANCE / 10
    assert m.step([]) == ([], None)
    assert m.step(segments)[1] is None
