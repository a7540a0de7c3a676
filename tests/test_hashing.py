"""Chained block hashes, extra keys and fingerprints."""

from __future__ import annotations

import pytest

from kvshm import BlockHasher, InvalidArgument, Request, hash_fingerprint
from kvshm.core.errors import ConfigError


def hashes(tokens, **kw):
    return Request("r", tokens, BlockHasher("sha256", "s", 4), **kw).block_hashes


def test_only_full_blocks_are_hashed_and_chains_extend_incrementally():
    h = BlockHasher("sha256", "s", 4)
    r = Request("r", list(range(7)), h)
    assert len(r.block_hashes) == 1
    r.append_token_ids([7])
    assert len(r.block_hashes) == 2
    assert r.block_hashes == hashes(list(range(8)))


def test_equal_hash_iff_equal_prefix():
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = hashes([1, 2, 3, 4, 5, 6, 7, 9, 0, 0, 0, 0])
    c = hashes([0, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] == b[0] and a[1] != b[1]
    assert c[0] != a[0] and c[1] != a[1]  # the chain carries the difference


def test_salt_on_block_zero_and_lora_on_every_block():
    base = hashes(list(range(8)))
    salted = hashes(list(range(8)), cache_salt="x")
    lora = hashes(list(range(8)), lora_name="a")
    assert salted[0] != base[0] and salted[1] != base[1]
    assert len({*base, *salted, *lora}) == 6
    assert hashes(list(range(8)), cache_salt="") == base  # empty salt is no salt


def test_seed_and_algorithm_change_hashes_and_fingerprint():
    tok = list(range(4))
    a = Request("r", tok, BlockHasher("sha256", "one", 4)).block_hashes
    b = Request("r", tok, BlockHasher("sha256", "two", 4)).block_hashes
    c = Request("r", tok, BlockHasher("xxh3_128", "one", 4)).block_hashes
    assert a != b and a != c and len(c[0]) == 16 and len(a[0]) == 32
    assert hash_fingerprint("sha256", "one") == BlockHasher("sha256", "one", 4).fingerprint
    assert len({hash_fingerprint("sha256", "one"), hash_fingerprint("sha256", "two"),
                hash_fingerprint("xxh3_128", "one")}) == 3


def test_bad_tokens_leave_the_request_unchanged():
    r = Request("r", [1, 2, 3], BlockHasher("sha256", "s", 4))
    with pytest.raises(InvalidArgument, match="token ids"):
        r.append_token_ids([2**32])
    assert r.all_token_ids == [1, 2, 3] and r.block_hashes == []
    with pytest.raises(InvalidArgument):
        Request("q", [-1, 0, 0, 0], BlockHasher("sha256", "s", 4))


def test_unknown_algorithm_and_bad_block_size():
    with pytest.raises(ConfigError, match="hash_algorithm"):
        BlockHasher("md5", "s", 4)
    with pytest.raises(InvalidArgument):
        BlockHasher("sha256", "s", 0)
