"""Chained block hashes for prefix caching, and the hash fingerprint.

hash(block i) = H(hash(block i-1), tokens of block i, extra keys of block i),
with a seed-derived hash standing in for hash(block -1).  Extra keys (the
LoRA name, multimodal items, the cache salt, prompt embeds) are per block:
`kvshm.core.extra_keys`.

Two families of algorithms:

- kvshm's own (`sha256`, `xxh3_128`): an injective byte encoding (fixed-width
  parent and tokens, length-prefixed keys), so equal hashes mean equal token
  prefixes and equal extra keys;
- vLLM 0.14's (`vllm-sha256`, `vllm-sha256-cbor`): byte for byte the hashes a
  vLLM engine computes with `prefix_caching_hash_algo` `sha256` (pickle) or
  `sha256_cbor` (canonical CBOR), the seed playing PYTHONHASHSEED's part, so a
  pool can take the `block_hashes` vLLM requests already carry.

Token ids: kvshm's own algorithms pack each id in 4 bytes, so they take
ids in [0, 2**32); vLLM's hash whatever ints a request holds, placeholders
such as -1 included (vLLM's own multimodal tests use it), so the vLLM
algorithms take every 64-bit id, the range of vLLM's token tensors
(`TokenRange`).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from kvshm.core.errors import ConfigError, InvalidArgument
from kvshm.core.extra_keys import ExtraKeys, MultiModalFeature

HASH_SLOT_BYTES = 32  # room for one hash in the shared-memory block table

# Every algorithm a pool can name; the vLLM ones mirror vLLM's names.
HASH_ALGORITHMS = ("sha256", "xxh3_128", "vllm-sha256", "vllm-sha256-cbor")
# kvshm algorithm -> vLLM's `prefix_caching_hash_algo` it reproduces.
VLLM_HASH_ALGORITHMS = {"vllm-sha256": "sha256", "vllm-sha256-cbor": "sha256_cbor"}
# A pool's hashing unless its config says otherwise (and what a client
# expects unless told).
DEFAULT_HASH_ALGORITHM = "sha256"
DEFAULT_HASH_SEED = "kvshm-0"


class TokenRange:
    """The token ids a hashing takes: `typecode` is the `array` type whose
    range they are (a C-speed check), `why` the reason, for the error."""

    __slots__ = ("typecode", "text", "why")

    def __init__(self, typecode: str, text: str, why: str) -> None:
        self.typecode, self.text, self.why = typecode, text, why

    def check(self, tokens: list) -> None:
        """Raise InvalidArgument unless every one of `tokens` is an int in
        the range."""
        try:
            array(self.typecode, tokens)
        except (TypeError, OverflowError):
            raise self.error() from None

    def error(self) -> InvalidArgument:
        return InvalidArgument(f"token ids must be integers in {self.text} ({self.why})")


# vLLM's algorithms (and a request that is not hashed): any 64-bit id.
VLLM_TOKEN_RANGE = TokenRange("q", "[-2**63, 2**63)", "64-bit, as vLLM's token tensors")
KVSHM_TOKEN_RANGE = TokenRange(
    "I", "[0, 2**32)", "kvshm's own hash algorithms pack each id in 4 bytes; "
    "a pool hashing with vllm-sha256 or vllm-sha256-cbor takes any 64-bit id, -1 included")

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
    """cbor_canonical(tuple(tokens)) for checked token ids (64-bit ints)."""
    return _cbor_head(4, len(tokens)) + b"".join(map(_cbor_token, tokens))


def _cbor_token(n: int) -> bytes:
    # cbor_canonical of one checked token id, the common ranges inline.
    if 0 <= n < 24:
        return _SMALL[n]
    if 0 <= n < 0x100:
        return b"\x18" + n.to_bytes(1, "big")
    if 0 <= n < 0x10000:
        return b"\x19" + n.to_bytes(2, "big")
    return _cbor_head(0, n) if n >= 0 else _cbor_head(1, -1 - n)


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


class BlockHasher:
    """Computes a request's full-block hashes at `block_size`-token granularity.

    One instance per pool (algorithm, seed, block size); stateless across
    requests, so it can be shared.
    """

    __slots__ = ("algorithm", "seed", "block_size", "digest_size", "none_hash",
                 "fingerprint", "namespace", "vllm", "tagged", "token_range", "_fn", "_pack",
                 "_ns")

    def __init__(self, algorithm: str, seed: str, block_size: int,
                 namespace: str = "", *, tagged: bool = False) -> None:
        """`tagged`: extra keys as vLLM 0.32 encodes them (for its
        algorithms; `Semantics.tagged_extra_keys`), else as 0.14."""
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be positive (got {block_size})")
        self.algorithm = algorithm
        self.seed = seed
        self.block_size = block_size
        self._fn = _raw_function(algorithm)
        self.vllm = algorithm in VLLM_HASH_ALGORITHMS
        self.tagged = tagged and self.vllm
        # The token ids it hashes (module doc).
        self.token_range = VLLM_TOKEN_RANGE if self.vllm else KVSHM_TOKEN_RANGE
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
        return BlockHasher(self.algorithm, self.seed, self.block_size, namespace,
                           tagged=self.tagged)

    def extra_keys(self, lora_name: str | None = None, cache_salt: str | None = None,
                   mm_features: tuple[MultiModalFeature, ...] = (),
                   embeds: bytes | None = None, row_bytes: int = 0,
                   lora_path: str | None = None) -> ExtraKeys:
        """A request's extra keys in this hasher's encoding, for `hash_blocks`
        (`mm_features` checked by `check_mm_features`, `embeds` and
        `row_bytes` from `embeds_rows`).  Raises InvalidArgument for a LoRA
        without `lora_path` where the encoding (vLLM 0.32's) needs it."""
        return ExtraKeys(self.vllm, lora_name, cache_salt, mm_features, embeds, row_bytes,
                         lora_path, self.tagged)

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
        extra: ExtraKeys | None = None,
    ) -> list[bytes]:
        """Hashes of the full blocks from index `start_block` on, in one
        pass (see `kvshm.core.extra_keys` for why passes matter).

        `parent` is the hash of block `start_block - 1` (None for block 0);
        `extra` comes from `extra_keys()` (None: no extra keys).
        Raises `InvalidArgument` for a token id outside `token_range`.
        """
        bs = self.block_size
        n_full = len(token_ids) // bs
        if start_block >= n_full:
            return []
        prev = self.none_hash if parent is None else parent
        keys = None if extra is None else extra.for_blocks(start_block, n_full, bs)
        if self.vllm:
            return self._hash_vllm(token_ids, start_block, n_full, prev, keys)
        fn, pack = self._fn, self._pack
        out = []
        try:
            for i in range(start_block, n_full):
                lo = i * bs
                key = b"" if keys is None else keys[i - start_block]
                prev = fn(prev + pack(*token_ids[lo:lo + bs]) + key)
                out.append(prev)
        except struct.error:
            raise self.token_range.error() from None
        return out

    def _hash_vllm(self, token_ids, start_block, n_full, prev, keys) -> list[bytes]:
        # NOTE: vLLM hashes (parent, tuple(tokens), extra_keys) with the
        # serializer its algorithm names; the check that tokens are ints in
        # range comes first, so a bad id raises before anything is hashed.
        bs = self.block_size
        self.token_range.check(token_ids[start_block * bs:n_full * bs])
        out = []
        if self.algorithm == "vllm-sha256":
            for i in range(start_block, n_full):
                lo = i * bs
                key = None if keys is None else keys[i - start_block]
                prev = _sha256(_pickle((prev, tuple(token_ids[lo:lo + bs]), key)))
                out.append(prev)
            return out
        for i in range(start_block, n_full):
            lo = i * bs
            body = _cbor_tokens(token_ids[lo:lo + bs])
            extra = b"\xf6" if keys is None else cbor_canonical(keys[i - start_block])
            prev = _sha256(b"\x83" + _cbor_head(2, len(prev)) + prev + body + extra)
            out.append(prev)
        return out
