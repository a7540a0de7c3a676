"""A request's extra block-hash keys: what, besides its tokens, tells its
blocks apart from another request's.

Per block, in vLLM 0.14's order:

1. the LoRA name, on every block;
2. the identifier (hash) of every multimodal item whose placeholder the
   block overlaps;
3. the cache salt, on block 0 only;
4. for a prompt-embeds request, the block's rows of the embeddings as raw
   bytes (empty for blocks past the prompt, but present).

Placeholders are walked the way vLLM walks them, quirks included, so that
`vllm-sha256` hashes stay vLLM's byte for byte: within one hashing pass the
walk moves forward through the items sorted by offset; a block has passed an
item only when it starts *after* the item's end (a block starting exactly
at the end still names it, unless the same pass already moved on), and it
moves on from an item whose end it contains.  A request's first pass (at
block 0) starts at the first item; later passes (blocks completed by
appended tokens) start at the last item.  So the keys of a block depend on
which pass hashed it: a prompt is hashed in one pass when the request is
made, and each append that completes blocks makes one more.

kvshm's own algorithms encode the same keys injectively (tagged,
length-prefixed), and add each item's offset and length, so equal hashes
mean equal placeholders too.  Requests without items or embeds encode as
before items existed, so their hashes did not change.

vLLM 0.32 (`tagged`: a pool of its semantics, `Semantics.tagged_extra_keys`)
tags each key with its source, in the same order: `("lora", name, path)`,
`("mm", identifier, offset of the item in the block)`, `("cache_salt",
salt)`, `("prompt_embeds", sha256 digest of the block's rows)`.  A block
names exactly the items it overlaps, whichever pass hashes it (no quirks).
Its KV events publish the same keys untagged (`block_event_keys`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvshm.core.errors import BadMultimodalInput, InvalidArgument


class MultiModalFeature(NamedTuple):
    """One multimodal item of a prompt: its placeholder tokens are
    `offset .. offset + length - 1`, and `identifier` is the item's hash (vLLM's
    `MultiModalFeatureSpec.identifier`: equal items, equal identifiers)."""

    offset: int
    length: int
    identifier: str


def _is_int(v: Any) -> bool:
    return v.__class__ is int


def check_mm_features(features: Sequence[Any] | None,
                      num_prompt_tokens: int) -> tuple[MultiModalFeature, ...]:
    """The features as `MultiModalFeature`s sorted by offset (vLLM's
    order); each may be a `MultiModalFeature` or an (offset, length,
    identifier) sequence.  Raises `BadMultimodalInput` unless every
    placeholder lies inside the prompt, none overlaps another and every
    identifier is a non-empty string."""
    if not features:
        return ()
    if isinstance(features, (str, bytes)) or not isinstance(features, Sequence):
        raise BadMultimodalInput("mm_features must be a list of (offset, length, identifier)")
    out = []
    for i, f in enumerate(features):
        if isinstance(f, (str, bytes)) or not isinstance(f, Sequence) or len(f) != 3:
            raise BadMultimodalInput(
                f"mm_features[{i}] must be (offset, length, identifier), got {f!r}")
        offset, length, ident = f
        if not (_is_int(offset) and _is_int(length)) or offset < 0 or length < 1:
            raise BadMultimodalInput(
                f"mm_features[{i}]: offset must be an integer >= 0 and length one >= 1 "
                f"(got {offset!r}, {length!r})")
        if ident.__class__ is not str or not ident:
            raise BadMultimodalInput(
                f"mm_features[{i}]: the identifier must be a non-empty string (the item's "
                f"hash), got {ident.__class__.__name__} {ident!r}")
        if offset + length > num_prompt_tokens:
            raise BadMultimodalInput(
                f"mm_features[{i}]: placeholder {offset}..{offset + length - 1} is outside "
                f"the prompt of {num_prompt_tokens} tokens")
        out.append(MultiModalFeature(offset, length, ident))
    out.sort(key=lambda f: f.offset)
    for a, b in zip(out, out[1:]):
        if a.offset + a.length > b.offset:
            raise BadMultimodalInput(
                f"placeholders overlap: {a.identifier!r} at {a.offset}..{a.offset + a.length - 1}"
                f" and {b.identifier!r} at {b.offset}..{b.offset + b.length - 1}")
    return tuple(out)


def embeds_rows(prompt_embeds: Any, num_tokens: int | None) -> tuple[bytes, int]:
    """(raw bytes, bytes per row) of prompt embeddings, one row per prompt
    token, in row-major order (what vLLM hashes: the tensor's own dtype).

    `prompt_embeds` is any object with the buffer protocol (bytes, a numpy
    array, `tensor.view(torch.uint8).numpy()`).  The row count is
    `num_tokens` when given (a 2-D buffer's first dimension must agree),
    else the buffer's first dimension."""
    try:
        view = memoryview(prompt_embeds)
    except TypeError:
        raise BadMultimodalInput(
            "prompt_embeds must support the buffer protocol (bytes, a numpy array), "
            f"got {prompt_embeds.__class__.__name__}") from None
    rows = view.shape[0] if view.ndim >= 2 else None
    if num_tokens is None:
        if rows is None:
            raise BadMultimodalInput(
                "prompt_embeds as flat bytes need the prompt's token count: give "
                "prompt token ids (vLLM uses zeros) or a 2-D array")
    elif rows is not None and rows != num_tokens:
        raise BadMultimodalInput(
            f"prompt_embeds has {rows} rows for a prompt of {num_tokens} tokens")
    else:
        rows = num_tokens
    if rows < 1 or view.nbytes % rows:
        raise BadMultimodalInput(
            f"prompt_embeds of {view.nbytes} bytes do not split into {rows} equal rows")
    return view.tobytes(), view.nbytes // rows


def _mm_walk(features: tuple[MultiModalFeature, ...], start: int, end: int,
             idx: int) -> tuple[list[MultiModalFeature], int]:
    """The items block [start, end) names, and where the walk goes on
    (idx < 0 counts from the last item)."""
    last = features[-1]
    if last.offset + last.length < start:
        return [], idx
    if idx < 0:
        idx += len(features)
    named = []
    while idx < len(features):
        f = features[idx]
        if end <= f.offset:
            break
        if start > f.offset + f.length:
            idx += 1
            continue
        named.append(f)
        if end < f.offset + f.length:
            break
        idx += 1
    return named, idx


def _tagged(tag: bytes, raw: bytes, width: int = 4) -> bytes:
    return tag + len(raw).to_bytes(width, "little") + raw


class ExtraKeys:
    """One request's extra keys, in its hasher's encoding: tuples (or None)
    for vLLM's algorithms, bytes for kvshm's.  Without multimodal items or
    embeds the keys are constant (`every`, and `first` for block 0)."""

    __slots__ = ("vllm", "tagged", "lora_name", "cache_salt", "mm_features", "embeds",
                 "row_bytes", "constant", "every", "first")

    def __init__(self, vllm: bool, lora_name: str | None = None, cache_salt: str | None = None,
                 mm_features: tuple[MultiModalFeature, ...] = (),
                 embeds: bytes | None = None, row_bytes: int = 0,
                 lora_path: str | None = None, tagged: bool = False) -> None:
        self.vllm = vllm
        self.tagged = tagged
        self.lora_name = lora_name or None
        self.cache_salt = cache_salt or None
        self.mm_features = mm_features
        self.embeds = embeds
        self.row_bytes = row_bytes
        self.constant = not mm_features and embeds is None
        if tagged:
            if lora_name and lora_path is None:
                raise InvalidArgument(
                    f"LoRA {lora_name!r} needs its lora_path: vLLM 0.32 hashes the adapter's "
                    "path with its name (this pool reproduces 0.32)")
            every = (("lora", lora_name, lora_path),) if lora_name else ()
            first = every + (("cache_salt", cache_salt),) if cache_salt else every
            self.every, self.first = every or None, first or None
        elif vllm:
            every = (lora_name,) if lora_name else ()
            first = every + (cache_salt,) if cache_salt else every
            self.every, self.first = every or None, first or None
        else:
            self.every = _tagged(b"L", lora_name.encode()) if lora_name else b""
            self.first = self.every + (_tagged(b"S", cache_salt.encode()) if cache_salt else b"")

    def for_blocks(self, start_block: int, n_full: int, block_size: int) -> list[Any]:
        """The keys of blocks `start_block .. n_full - 1`, hashed in one pass."""
        if self.constant:
            first, every = self.first, self.every
            return [first if i == 0 else every for i in range(start_block, n_full)]
        features, embeds, rb = self.mm_features, self.embeds, self.row_bytes
        if self.tagged:
            return [self._tagged_keys(i * block_size, (i + 1) * block_size)
                    for i in range(start_block, n_full)]
        idx = 0 if start_block == 0 else -1
        out = []
        for i in range(start_block, n_full):
            start = i * block_size
            end = start + block_size
            named = []
            if features:
                named, idx = _mm_walk(features, start, end, idx)
            rows = None if embeds is None else embeds[start * rb:end * rb]
            out.append(self._encode(named, i == 0, rows))
        return out

    def _tagged_keys(self, start: int, end: int) -> tuple | None:
        """vLLM 0.32's keys of block [start, end)."""
        keys = list(self.every or ())
        for f in self.mm_features:
            if f.offset >= end:
                break
            if start < f.offset + f.length:
                keys.append(("mm", f.identifier, f.offset - start))
        if start == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        if self.embeds is not None:
            rb = self.row_bytes
            keys.append(("prompt_embeds",
                         hashlib.sha256(self.embeds[start * rb:end * rb]).digest()))
        return tuple(keys) if keys else None

    def _encode(self, named: list[MultiModalFeature], block0: bool, rows: bytes | None) -> Any:
        salt = self.cache_salt if block0 else None
        if self.vllm:
            keys = [self.lora_name] if self.lora_name else []
            keys += [f.identifier for f in named]
            if salt:
                keys.append(salt)
            if rows is not None:
                keys.append(rows)
            return tuple(keys) if keys else None
        parts = [self.every]
        for f in named:
            parts.append(_tagged(b"M", f.identifier.encode())
                         + f.offset.to_bytes(8, "little") + f.length.to_bytes(8, "little"))
        if salt:
            parts.append(_tagged(b"S", salt.encode()))
        if rows is not None:
            parts.append(_tagged(b"E", rows, 8))
        return b"".join(parts)


def block_event_keys(request: Any, indices: Sequence[int], block_size: int) -> list[Any]:
    """vLLM 0.32's extra keys of a request's blocks `indices` as its KV
    events publish them, one entry per block: the tagged keys of
    `ExtraKeys(tagged=True)` without their tags (the LoRA name, `(identifier,
    offset)` per item, the salt, the embeds digest); None for a block with
    none.

    `request` is a kvshm `Request` or, in a vLLM engine's embedded pool,
    vLLM's own (its LoRA request, feature specs, and the per-block embeds
    digests it kept when it hashed the blocks)."""
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name, path = lora.lora_name, lora.lora_path
    else:
        name, path = getattr(request, "lora_name", None), getattr(request, "lora_path", None)
    features = []
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        features.append(f if pos is None else
                        MultiModalFeature(pos.offset, pos.length, f.identifier))
    embeds = getattr(request, "prompt_embeds", None)
    # vLLM's request keeps each block's embeds digest; kvshm's the raw rows.
    digests = (None if embeds is None else
               getattr(request, "_prompt_embeds_per_block_hashes", None))
    rows = embeds if embeds is not None and digests is None else None
    extra = ExtraKeys(True, name, getattr(request, "cache_salt", None), tuple(features),
                      rows, len(rows) // request.num_prompt_tokens if rows else 0,
                      path or "", tagged=True)
    out = []
    for i in indices:
        start, end = i * block_size, (i + 1) * block_size
        keys = [key[1:] if key[0] == "mm" else key[1]
                for key in extra._tagged_keys(start, end) or ()]
        if digests is not None:
            keys.append(digests[(start, end)])
        out.append(tuple(keys) if keys else None)
    return out
