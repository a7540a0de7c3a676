"""Chained block hashes for prefix caching, and the hash fingerprint.

hash(block i) = H(hash(block i-1) || tokens of block i || extra keys of block i),
with H(seed) standing in for hash(block -1).  Extra keys are the LoRA name (on
every block) and the cache salt (on block 0 only).  The input encoding is
injective (fixed-width parent and tokens, length-prefixed keys), so equal
hashes mean equal token prefixes and equal extra keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

from kvshm.core.errors import ConfigError, InvalidArgument

HASH_SLOT_BYTES = 32  # room for one hash in the shared-memory block table

_SCHEME = b"kvshm-block-hash-v1"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _hash_function(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm == "sha256":
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
    raise ConfigError("hash_algorithm", f"unknown algorithm {algorithm!r}")


def digest_size(algorithm: str) -> int:
    """Bytes in one block hash of `algorithm`."""
    return len(_hash_function(algorithm)(b""))


def hash_fingerprint(algorithm: str, seed: str) -> str:
    """A short, stable id of (algorithm, seed): processes whose fingerprints
    differ compute different hashes for the same tokens."""
    digest = hashlib.sha256(_SCHEME + b"\0" + algorithm.encode() + b"\0" + seed.encode())
    return digest.hexdigest()[:16]


def encode_extra_keys(lora_name: str | None, cache_salt: str | None) -> tuple[bytes, bytes]:
    """(bytes appended to every block, bytes appended to block 0 only)."""
    every = b""
    if lora_name:
        raw = lora_name.encode()
        every = b"L" + len(raw).to_bytes(4, "little") + raw
    first = every
    if cache_salt:
        raw = cache_salt.encode()
        first = every + b"S" + len(raw).to_bytes(4, "little") + raw
    return every, first


class BlockHasher:
    """Computes a request's full-block hashes at `block_size`-token granularity.

    One instance per pool (algorithm, seed, block size); stateless across
    requests, so it can be shared.
    """

    __slots__ = ("algorithm", "seed", "block_size", "digest_size", "none_hash",
                 "fingerprint", "namespace", "_fn", "_pack", "_ns")

    def __init__(self, algorithm: str, seed: str, block_size: int,
                 namespace: str = "") -> None:
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be positive (got {block_size})")
        self.algorithm = algorithm
        self.seed = seed
        self.block_size = block_size
        self._fn = _hash_function(algorithm)
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
        extra_every: bytes = b"",
        extra_first: bytes = b"",
    ) -> list[bytes]:
        """Hashes of the full blocks from index `start_block` on.

        `parent` is the hash of block `start_block - 1` (None for block 0).
        Raises `InvalidArgument` for a token id outside [0, 2**32).
        """
        bs = self.block_size
        n_full = len(token_ids) // bs
        if start_block >= n_full:
            return []
        fn, pack = self._fn, self._pack
        prev = self.none_hash if parent is None else parent
        out = []
        try:
            for i in range(start_block, n_full):
                lo = i * bs
                extra = extra_first if i == 0 else extra_every
                prev = fn(prev + pack(*token_ids[lo:lo + bs]) + extra)
                out.append(prev)
        except struct.error:
            raise InvalidArgument(
                "token ids must be integers in [0, 2**32)"
            ) from None
        return out
