"""Chained block hashes, extra keys and fingerprints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshm import BlockHasher, InvalidArgument, Request, hash_fingerprint
from kvshm.core.errors import ConfigError
from kvshm.core.hashing import cbor_canonical, vllm_none_hash


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


# -- vLLM's own algorithms ------------------------------------------------------
# tests/data/vllm_block_hashes.json was recorded from vLLM 0.14.0's
# `hash_block_tokens` and `init_none_hash` (PYTHONHASHSEED = the seed), run
# through ../shared/oracle, over token ids that hit every integer width.
VLLM_VECTORS = json.loads((Path(__file__).parent / "data" / "vllm_block_hashes.json").read_text())


@pytest.mark.parametrize("case", VLLM_VECTORS["cases"],
                         ids=lambda c: f"{c['algorithm']}-{c['seed']}-{c['block_size']}")
def test_vllm_algorithms_reproduce_vllm_hashes_byte_for_byte(case):
    h = BlockHasher(case["algorithm"], case["seed"], case["block_size"])
    assert h.none_hash.hex() == case["none_hash"]
    r = Request("r", case["token_ids"], h, lora_name=case["lora_name"],
                cache_salt=case["cache_salt"])
    assert [b.hex() for b in r.block_hashes] == case["block_hashes"]


def test_vllm_hashes_extend_incrementally_and_validate_tokens():
    h = BlockHasher("vllm-sha256-cbor", "0", 4)
    whole = Request("a", list(range(12)), h).block_hashes
    r = Request("b", list(range(5)), h)
    r.append_token_ids(range(5, 12))
    assert r.block_hashes == whole
    for bad in ([-2**63 - 1, 0, 0, 0], [0, 0, 0, 2**63], [0, "x", 0, 0], [0, 1.0, 0, 0]):
        for algorithm in ("vllm-sha256-cbor", "vllm-sha256"):
            with pytest.raises(InvalidArgument, match=r"token ids must be integers in "
                                                      r"\[-2\*\*63, 2\*\*63\) \(64-bit"):
                BlockHasher(algorithm, "0", 4).hash_blocks(bad, 0, None)
            with pytest.raises(InvalidArgument, match="token ids"):
                Request("c", bad, BlockHasher(algorithm, "0", 4))


@pytest.mark.parametrize("algorithm", ["vllm-sha256", "vllm-sha256-cbor"])
def test_vllm_algorithms_take_every_64_bit_id_as_vllm_does(algorithm):
    """vLLM hashes whatever ints a request holds: its own multimodal test
    puts -1 where an image goes.  (The stored vectors, recorded from vLLM,
    check the bytes; tests/test_multimodal.py.)"""
    h = BlockHasher(algorithm, "0", 4)
    ids = [-1, -1, -1, 7, -2**63, 2**63 - 1, 2**32, -257]
    r = Request("r", ids[:5], h)
    r.append_token_ids(ids[5:])
    assert r.block_hashes == Request("w", ids, h).block_hashes
    assert len(r.block_hashes) == 2 and r.all_token_ids == ids
    assert Request("r", [-1]).all_token_ids == [-1]          # no hasher: any 64-bit id


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_kvshm_s_own_algorithms_keep_their_range_and_say_why(algorithm):
    h = BlockHasher(algorithm, "s", 4)
    why = r"\[0, 2\*\*32\) \(kvshm's own hash algorithms pack each id in 4 bytes; a pool " \
          r"hashing with vllm-sha256 or vllm-sha256-cbor takes any 64-bit id, -1 included\)"
    for bad in ([-1, 0, 0, 0], [0, 0, 0, 2**32]):
        with pytest.raises(InvalidArgument, match=why):
            Request("r", bad, h)
        with pytest.raises(InvalidArgument, match=why):
            h.hash_blocks(bad, 0, None)
    r = Request("r", [1, 2], h)
    with pytest.raises(InvalidArgument, match=why):
        r.append_token_ids([3, -1])
    assert r.all_token_ids == [1, 2] and r.num_tokens == 2 and r.block_hashes == []


def test_canonical_cbor_matches_the_rfc_examples():
    # RFC 8949 appendix A.
    assert cbor_canonical(0) == bytes.fromhex("00")
    assert cbor_canonical(23) == bytes.fromhex("17")
    assert cbor_canonical(24) == bytes.fromhex("1818")
    assert cbor_canonical(1000) == bytes.fromhex("1903e8")
    assert cbor_canonical(1000000) == bytes.fromhex("1a000f4240")
    assert cbor_canonical(1000000000000) == bytes.fromhex("1b000000e8d4a51000")
    assert cbor_canonical(-1000) == bytes.fromhex("3903e7")
    assert cbor_canonical("IETF") == bytes.fromhex("6449455446")
    assert cbor_canonical(b"\x01\x02\x03\x04") == bytes.fromhex("4401020304")
    assert cbor_canonical((1, [2, 3], None)) == bytes.fromhex("8301820203f6")
    with pytest.raises(InvalidArgument, match="float"):
        cbor_canonical(1.5)
    with pytest.raises(InvalidArgument, match="too large"):
        cbor_canonical(2**64)


def test_vllm_none_hash_is_only_for_vllm_algorithms():
    assert vllm_none_hash("vllm-sha256", "0") == BlockHasher("vllm-sha256", "0", 16).none_hash
    with pytest.raises(ConfigError, match="not one of vLLM"):
        vllm_none_hash("sha256", "0")
