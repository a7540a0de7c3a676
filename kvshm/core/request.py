"""Per-request state a scheduler keeps: tokens, progress and block hashes.

Block hashes are extended incrementally whenever tokens are appended, so a
lookup never rehashes a prompt.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from kvshm.core.errors import InvalidArgument
from kvshm.core.hashing import BlockHasher, encode_extra_keys


def _checked_tokens(token_ids: Iterable[int]) -> list[int]:
    """The tokens as a list; raises InvalidArgument unless every one is an
    integer in [0, 2**32)."""
    tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
    try:
        array("I", tokens)  # C-speed type and range check
    except (TypeError, OverflowError):
        raise InvalidArgument("token ids must be integers in [0, 2**32)") from None
    return tokens


class Request:
    """A request as the KV-cache manager sees it.

    Attributes mirror vLLM's request where they name the same thing:
    `request_id`, `all_token_ids`, `num_tokens`, `num_computed_tokens`,
    `block_hashes`, `lora_name`, `cache_salt`, `skip_reading_prefix_cache`.
    `hasher` may be None (caching off): then `block_hashes` stays empty.
    """

    __slots__ = ("request_id", "all_token_ids", "num_computed_tokens", "block_hashes",
                 "lora_name", "cache_salt", "skip_reading_prefix_cache",
                 "num_preemptions", "_hasher", "_extra_every", "_extra_first")

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        hasher: BlockHasher | None = None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument("request_id must be a non-empty string")
        self.request_id = request_id
        self.all_token_ids: list[int] = _checked_tokens(list(prompt_token_ids))
        self.num_computed_tokens = 0
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.num_preemptions = 0
        self._hasher = hasher
        self._extra_every, self._extra_first = encode_extra_keys(lora_name, cache_salt)
        self.block_hashes: list[bytes] = []
        self._extend_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token_ids(self, token_ids: Iterable[int]) -> None:
        """Append tokens (decoded or speculative) and hash new full blocks."""
        tokens = self.all_token_ids
        tokens.extend(_checked_tokens(token_ids))
        hasher = self._hasher
        if hasher is not None and (len(self.block_hashes) + 1) * hasher.block_size <= len(tokens):
            self._extend_hashes()

    def _extend_hashes(self) -> None:
        hasher = self._hasher
        if hasher is None:
            return
        hashes = self.block_hashes
        if (len(hashes) + 1) * hasher.block_size > len(self.all_token_ids):
            return
        hashes.extend(hasher.hash_blocks(
            self.all_token_ids, len(hashes), hashes[-1] if hashes else None,
            self._extra_every, self._extra_first,
        ))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")
