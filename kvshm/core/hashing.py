"""Chained block hashes for prefix caching, and the hash fingerprint.

hash(block i) = H(hash(block i-1), tokens of block i, extra keys of block i),
with a seed-derived hash standing in for hash(block -1).  Extra keys are the
LoRA name (on every block) and the cache salt (on block 0 only).

Two families of algorithms:

- kvshm's own (`sha256`, `xxh3_128`): an injective byte encoding (fixed-width
  parent and tokens, length-prefixed keys), so equal hashes mean equal token
  prefixes and equal extra keys;
- vLLM 0.14's (`vllm-sha256`, `vllm-sha256-cbor`): byte for byte the hashes a
  vLLM engine computes with `prefix_caching_hash_algo` `sha256` (pickle) or
  `sha256_cbor` (canonical CBOR), the seed playing PYTHONHASHSEED's part, so a
  pool can take the `block_hashes` vLLM requests already carry.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from kvshm.core.errors import ConfigError, InvalidArgument

HASH_SLOT_BYTES = 32  # room for one hash in the shared-memory block table

# Every algorithm a pool can name; the vLLM ones mirror vLLM's names.
HASH_ALGORITHMS = ("sha256", "xxh3_128", "vllm-sha256", "vllm-sha256-cbor")
# kvshm algorithm -> vLLM's `prefix_caching_hash_algo` it reproduces.
VLLM_HASH_ALGORITHMS = {"vllm-sha256": "sha256", "vllm-sha256-cbor": "sha256_cbor"}
# A pool's hashing unless its config says otherwise (and what a client
# expects unless told).
DEFAULT_HASH_ALGORITHM = "sha256"
DEFAULT_HASH_SEED = "kvshm-0"

_SCHEME = b"kvshm-block-hash-v1"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_head(major: int, n: int) -> bytes:
    """A canonical CBOR item head: the shortest encoding of `n`."""
    if n < 24:
        return bytes((major << 5 | n,))
    if n < 0x100:
        return bytes((major << 5 | 24, n))
    if n < 0x10000:
        return bytes((major << 5 | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((major << 5 | 26,)) + n.to_bytes(4, "big")
    if n < 0x10000000000000000:
        return bytes((major << 5 | 27,)) + n.to_bytes(8, "big")
    raise InvalidArgument(f"integer {n} is too large for a block hash input")


def cbor_canonical(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949, shortest forms) of the values a block hash
    input holds: None, bools, ints, bytes, strs, tuples and lists of them."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    cls = obj.__class__
    if cls is int:
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if cls is bytes:
        return _cbor_head(2, len(obj)) + obj
    if cls is str:
        raw = obj.encode()
        return _cbor_head(3, len(raw)) + raw
    if cls is tuple or cls is list:
        return _cbor_head(4, len(obj)) + b"".join(map(cbor_canonical, obj))
    raise InvalidArgument(f"cannot encode {cls.__name__} in a block hash input")


def _cbor_tokens(tokens: Sequence[int]) -> bytes:
    """cbor_canonical(tuple(tokens)) for checked token ids (ints in [0, 2**32))."""
    return _cbor_head(4, len(tokens)) + b"".join(map(_cbor_uint, tokens))


def _cbor_uint(n: int) -> bytes:
    if n < 24:
        return _SMALL[n]
    if n < 0x100:
        return b"\x18" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\x19" + n.to_bytes(2, "big")
    return b"\x1a" + n.to_bytes(4, "big")


_SMALL = [bytes((n,)) for n in range(24)]


def _raw_function(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm in ("sha256", "vllm-sha256", "vllm-sha256-cbor"):
        return _sha256
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise ConfigError(
                "hash_algorithm",
                "xxh3_128 needs the xxhash package (pip install 'kvshm[fast]')",
            ) from None
        return xxhash.xxh3_128_digest
    raise ConfigError("hash_algorithm",
                      f"unknown algorithm {algorithm!r} (one of {', '.join(HASH_ALGORITHMS)})")


def digest_size(algorithm: str) -> int:
    """Bytes in one block hash of `algorithm`."""
    return len(_raw_function(algorithm)(b""))


def hash_fingerprint(algorithm: str, seed: str) -> str:
    """A short, stable id of (algorithm, seed): processes whose fingerprints
    differ compute different hashes for the same tokens."""
    digest = hashlib.sha256(_SCHEME + b"\0" + algorithm.encode() + b"\0" + seed.encode())
    return digest.hexdigest()[:16]


def vllm_none_hash(algorithm: str, seed: str) -> bytes:
    """The parent hash of block 0 that vLLM derives from PYTHONHASHSEED=seed
    for the vLLM algorithm `algorithm`."""
    if algorithm == "vllm-sha256":
        return _sha256(_pickle(seed))
    if algorithm == "vllm-sha256-cbor":
        return _sha256(cbor_canonical(seed))
    raise ConfigError("hash_algorithm", f"{algorithm!r} is not one of vLLM's algorithms")


def encode_extra_keys(lora_name: str | None, cache_salt: str | None) -> tuple[bytes, bytes]:
    """(bytes appended to every block, bytes appended to block 0 only) in
    kvshm's own encoding."""
    every = b""
    if lora_name:
        raw = lora_name.encode()
        every = b"L" + len(raw).to_bytes(4, "little") + raw
    first = every
    if cache_salt:
        raw = cache_salt.encode()
        first = every + b"S" + len(raw).to_bytes(4, "little") + raw
    return every, first


def vllm_extra_keys(lora_name: str | None,
                    cache_salt: str | None) -> tuple[tuple | None, tuple | None]:
    """(extra keys of every block, of block 0) as vLLM builds them: the LoRA
    name, then the cache salt on block 0; None when there are none."""
    every = (lora_name,) if lora_name else ()
    first = every + (cache_salt,) if cache_salt else every
    return every or None, first or None


class BlockHasher:
    """Computes a request's full-block hashes at `block_size`-token granularity.

    One instance per pool (algorithm, seed, block size); stateless across
    requests, so it can be shared.
    """

    __slots__ = ("algorithm", "seed", "block_size", "digest_size", "none_hash",
                 "fingerprint", "namespace", "vllm", "_fn", "_pack", "_ns")

    def __init__(self, algorithm: str, seed: str, block_size: int,
                 namespace: str = "") -> None:
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be positive (got {block_size})")
        self.algorithm = algorithm
        self.seed = seed
        self.block_size = block_size
        self._fn = _raw_function(algorithm)
        self.vllm = algorithm in VLLM_HASH_ALGORITHMS
        if self.vllm:
            self.none_hash = vllm_none_hash(algorithm, seed)
        else:
            self.none_hash = self._fn(_SCHEME + b"\0seed\0" + seed.encode())
        self.digest_size = len(self.none_hash)
        assert self.digest_size <= HASH_SLOT_BYTES
        self.fingerprint = hash_fingerprint(algorithm, seed)
        self._pack = struct.Struct(f"<{block_size}I").pack
        # A tenant's namespace: its cache keys are H(ns || hash), so tenants
        # never share (or poison) each other's blocks.  "" is the identity.
        self.namespace = namespace
        self._ns = (_SCHEME + b"\0tenant\0" + namespace.encode() + b"\0") if namespace else b""

    def for_namespace(self, namespace: str) -> "BlockHasher":
        """The same hasher with cache keys in `namespace`."""
        return BlockHasher(self.algorithm, self.seed, self.block_size, namespace)

    def extra_keys(self, lora_name: str | None, cache_salt: str | None) -> tuple[Any, Any]:
        """The (every block, block 0) extra keys `hash_blocks` takes."""
        if self.vllm:
            return vllm_extra_keys(lora_name, cache_salt)
        return encode_extra_keys(lora_name, cache_salt)

    def keys(self, hashes: list[bytes]) -> list[bytes]:
        """Prefix-cache keys of chained block hashes (the hashes themselves
        outside a namespace)."""
        ns = self._ns
        if not ns:
            return hashes
        fn = self._fn
        return [fn(ns + h) for h in hashes]

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        start_block: int,
        parent: bytes | None,
        extra_every: Any = None,
        extra_first: Any = None,
    ) -> list[bytes]:
        """Hashes of the full blocks from index `start_block` on.

        `parent` is the hash of block `start_block - 1` (None for block 0);
        the extra keys come from `extra_keys()` (None: none).
        Raises `InvalidArgument` for a token id outside [0, 2**32).
        """
        bs = self.block_size
        n_full = len(token_ids) // bs
        if start_block >= n_full:
            return []
        prev = self.none_hash if parent is None else parent
        if self.vllm:
            return self._hash_vllm(token_ids, start_block, n_full, prev,
                                   extra_every, extra_first)
        fn, pack = self._fn, self._pack
        every = extra_every or b""
        first = extra_first or b""
        out = []
        try:
            for i in range(start_block, n_full):
                lo = i * bs
                prev = fn(prev + pack(*token_ids[lo:lo + bs]) + (first if i == 0 else every))
                out.append(prev)
        except struct.error:
            raise InvalidArgument("token ids must be integers in [0, 2**32)") from None
        return out

    def _hash_vllm(self, token_ids, start_block, n_full, prev, every, first) -> list[bytes]:
        # NOTE: vLLM hashes (parent, tuple(tokens), extra_keys) with the
        # serializer its algorithm names; the check that tokens are ints in
        # range comes first, so a bad id raises before anything is hashed.
        bs = self.block_size
        try:
            array("I", token_ids[start_block * bs:n_full * bs])
        except (TypeError, OverflowError):
            raise InvalidArgument("token ids must be integers in [0, 2**32)") from None
        out = []
        if self.algorithm == "vllm-sha256":
            for i in range(start_block, n_full):
                lo = i * bs
                prev = _sha256(_pickle((prev, tuple(token_ids[lo:lo + bs]),
                                        first if i == 0 else every)))
                out.append(prev)
            return out
        for i in range(start_block, n_full):
            lo = i * bs
            body = _cbor_tokens(token_ids[lo:lo + bs])
            extra = cbor_canonical(first if i == 0 else every)
            prev = _sha256(b"\x83" + _cbor_head(2, len(prev)) + prev + body + extra)
            out.append(prev)
        return out
