"""Per-request state a scheduler keeps: tokens, progress and block hashes.

Block hashes are extended incrementally whenever tokens are appended, so a
lookup never rehashes a prompt.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from kvshm.core.errors import InvalidArgument
from kvshm.core.extra_keys import MultiModalFeature, check_mm_features, embeds_rows
from kvshm.core.hashing import VLLM_TOKEN_RANGE, BlockHasher, TokenRange


def _token_range(hasher: BlockHasher | None) -> TokenRange:
    """The token ids a request of `hasher` takes (any 64-bit id unhashed)."""
    return VLLM_TOKEN_RANGE if hasher is None else hasher.token_range


class Request:
    """A request as the KV-cache manager sees it.

    Attributes mirror vLLM's request where they name the same thing:
    `request_id`, `all_token_ids`, `num_tokens`, `num_prompt_tokens` (the tokens
    it was made with), `num_computed_tokens`,
    `block_hashes`, `lora_name`, `cache_salt`, `mm_features`,
    `prompt_embeds`, `skip_reading_prefix_cache`.
    `hasher` may be None (caching off): then `block_hashes` stays empty.
    Token ids must be in the hasher's `token_range` (any 64-bit id without
    one): InvalidArgument says which and why.

    `mm_features`: the prompt's multimodal items, (offset, length,
    identifier) each (`MultiModalFeature`), kept sorted by offset.
    `prompt_embeds`: the prompt's embeddings (any buffer, one row per prompt
    token); `prompt_token_ids` may then be None (the ids are zeros, as in
    vLLM) if the buffer is 2-D.  Both only change the block hashes
    (`kvshm.core.extra_keys`); they are checked before anything is kept
    (`BadMultimodalInput`).
    `lora_path`: the LoRA adapter's path, part of a block's extra keys on a
    pool hashing as vLLM 0.32 (which needs it with `lora_name`).

    A request made with `from_block_hashes` has no token ids
    (`all_token_ids` is None): its client hashed the tokens itself and sends
    hashes and token counts instead.
    """

    __slots__ = ("request_id", "all_token_ids", "num_tokens", "num_prompt_tokens",
                 "num_computed_tokens",
                 "block_hashes", "lora_name", "lora_path", "cache_salt", "mm_features",
                 "prompt_embeds",
                 "skip_reading_prefix_cache", "num_preemptions", "shared_prefix_boundary",
                 "_hasher", "_extra", "_parent", "_tokens")

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int] | None,
        hasher: BlockHasher | None = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] | None = None,
        prompt_embeds=None,
        skip_reading_prefix_cache: bool = False,
        lora_path: str | None = None,
    ) -> None:
        tokens = None
        if prompt_token_ids is not None:
            tokens = list(prompt_token_ids)
            _token_range(hasher).check(tokens)
        embeds, row_bytes = None, 0
        if prompt_embeds is not None:
            embeds, row_bytes = embeds_rows(prompt_embeds, None if tokens is None else len(tokens))
            if tokens is None:
                tokens = [0] * (len(embeds) // row_bytes)
        elif tokens is None:
            raise InvalidArgument("a request needs prompt_token_ids or prompt_embeds")
        features = check_mm_features(mm_features, len(tokens))
        self._setup(request_id, hasher, lora_name, cache_salt, skip_reading_prefix_cache,
                    features, embeds, row_bytes, lora_path)
        self.all_token_ids: list[int] | None = tokens
        self.num_tokens = self.num_prompt_tokens = len(tokens)
        self._extend_hashes()

    @classmethod
    def from_block_hashes(
        cls,
        request_id: str,
        block_hashes: list[bytes],
        num_tokens: int,
        hasher: BlockHasher | None = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> "Request":
        """A request known by its token count and the hashes of its full
        blocks, computed by the client with the pool's algorithm and seed
        (`hasher` maps them into its tenant's namespace).  Raises
        InvalidArgument when the hashes do not match the token count."""
        self = cls.__new__(cls)
        self._setup(request_id, hasher, lora_name, cache_salt, skip_reading_prefix_cache)
        self.all_token_ids = None
        self.num_tokens = 0
        self.append_block_hashes(block_hashes, num_tokens)
        self.num_prompt_tokens = self.num_tokens
        return self

    def _setup(self, request_id, hasher, lora_name, cache_salt, skip_read,
               features=(), embeds=None, row_bytes=0, lora_path=None) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument("request_id must be a non-empty string")
        self.request_id = request_id
        self.num_computed_tokens = 0
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.cache_salt = cache_salt
        self.mm_features = features
        self.prompt_embeds = embeds
        self.skip_reading_prefix_cache = skip_read
        self.num_preemptions = 0
        # vLLM 0.32: the prefix its last lookup found other requests share
        # (KVCacheManagerCore.get_computed_blocks sets it; 0: none).
        self.shared_prefix_boundary = 0
        self._hasher = hasher
        self._tokens = _token_range(hasher)
        self._extra = (None if hasher is None else
                       hasher.extra_keys(lora_name, cache_salt, features, embeds, row_bytes,
                                         lora_path))
        self.block_hashes: list[bytes] = []
        self._parent: bytes | None = None  # hash of the last full block (chain parent)

    def append_token_ids(self, token_ids: Iterable[int]) -> None:
        """Append tokens (decoded or speculative) and hash new full blocks."""
        tokens = self.all_token_ids
        if tokens is None:
            raise InvalidArgument(
                f"request {self.request_id!r} was made from block hashes: append hashes")
        if token_ids.__class__ is not list:
            token_ids = list(token_ids)
        allowed = self._tokens
        try:
            array(allowed.typecode, token_ids)  # allowed.check, inline: a decode step's hot path
        except (TypeError, OverflowError):
            raise allowed.error() from None
        tokens.extend(token_ids)
        self.num_tokens = len(tokens)
        hasher = self._hasher
        if hasher is not None and (len(self.block_hashes) + 1) * hasher.block_size <= len(tokens):
            self._extend_hashes()

    def append_block_hashes(self, block_hashes: list[bytes], num_new_tokens: int) -> None:
        """Grow a hash-only request by `num_new_tokens` tokens whose newly
        completed blocks hash to `block_hashes`."""
        if self.all_token_ids is not None:
            raise InvalidArgument(
                f"request {self.request_id!r} has token ids: append tokens")
        if num_new_tokens < 0:
            raise InvalidArgument(f"num_new_tokens must be >= 0 (got {num_new_tokens})")
        hasher = self._hasher
        num_tokens = self.num_tokens + num_new_tokens
        expected = 0 if hasher is None else (
            num_tokens // hasher.block_size - len(self.block_hashes))
        if len(block_hashes) != expected:
            raise InvalidArgument(
                f"request {self.request_id!r}: {num_tokens} tokens need {expected} new "
                f"block hashes, got {len(block_hashes)}")
        if block_hashes:
            size = hasher.digest_size
            for h in block_hashes:
                if h.__class__ is not bytes or len(h) != size:
                    raise InvalidArgument(
                        f"block hashes must be {size}-byte strings ({hasher.algorithm})")
            self._parent = block_hashes[-1]
            self.block_hashes.extend(hasher.keys(block_hashes))
        self.num_tokens = num_tokens

    def _extend_hashes(self) -> None:
        hasher = self._hasher
        if hasher is None:
            return
        hashes = self.block_hashes
        if (len(hashes) + 1) * hasher.block_size > len(self.all_token_ids):
            return
        raw = hasher.hash_blocks(self.all_token_ids, len(hashes), self._parent, self._extra)
        self._parent = raw[-1]
        hashes.extend(hasher.keys(raw))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")
