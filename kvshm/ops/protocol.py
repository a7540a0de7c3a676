"""Every wire type of the coordinator protocol, and how one is encoded as a
frame (`encode_frame`; the transport's frame reader is service/framing.py).

A frame is a 4-byte little-endian length, then the msgpack body: one of
these Structs.  The
client's first frame is `Hello`, answered by `Welcome` (or `Error`); after
that every frame carries one operation (or a `Batch` of them) and is
answered by exactly one frame, in order.  Errors are replies (`Error`), never
dropped connections, except for frames that cannot be parsed.
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

from kvshm.core.extra_keys import MultiModalFeature, check_mm_features, embeds_rows

PROTOCOL_VERSION = 11
MAX_BATCH_OPS = 4096
LENGTH_BYTES = 4                # a frame's length prefix

_encode = msgspec.msgpack.Encoder().encode
_length = struct.Struct("<I").pack      # LENGTH_BYTES, little-endian


def encode_frame(msg: msgspec.Struct) -> bytes:
    """Length prefix + msgpack body.  (The body, then one concatenation:
    0.3-0.5 us for a small reply here, against 0.7-0.9 us for encoding
    into a bytearray after its prefix and writing the length in place.)"""
    body = _encode(msg)
    return _length(len(body)) + body


class _Op(msgspec.Struct, frozen=True, array_like=True, gc=False, tag_field="op"):
    pass


# -- handshake ----------------------------------------------------------------------
class Hello(_Op, tag="hello"):
    version: int
    pid: int
    hash_fingerprint: str   # "": the client takes the pool's hashing from the Welcome
    node: int = -1
    tenant: str = ""
    token: str = ""
    admin_token: str = ""   # the coordinator's admin token: reset, evict, free queue
    resume_token: str = ""  # take back a session after a coordinator restart
    tenant_token: str = ""  # proves `tenant` where it is declared token:FILE
    resume_from: int = 0    # ... and the replies of frames from this seq on, if applied
    vllm_version: str = ""  # a vLLM engine's release: a pool of another's semantics refuses it


class Welcome(_Op, tag="welcome"):
    version: int
    session_id: int
    config: bytes          # the pool config as canonical JSON
    pool_segment: str
    hash_fingerprint: str
    arena_segment: str = ""   # the KV data arena ("" when the config has no kv shape)
    admin: bool = False       # the session may reset, evict and read the free queue
    # Resumable sessions.  Frames after the handshake are numbered 1, 2, ...
    # per session; `last_seq` is the last one applied (for a resumed session:
    # frames up to it took effect, later ones did not), `replies` the reply
    # bodies of frames `replies_from` .. last_seq (from Hello.resume_from, as
    # far as they are kept; b"" for one no longer kept), `requests` the ids
    # taken back (restore each with AddRequest, then Advance, before other
    # ops on it).
    resume_token: str = ""    # secret; "" when the pool has no record left for it
    resumed: bool = False
    last_seq: int = 0
    replies_from: int = 0
    replies: list[bytes] = []
    requests: list[str] = []
    resume_error: str = ""    # why a presented resume token was not honoured
    generation: int = 0       # the coordinator's incarnation (+1 per adoption)


# -- operations (they mirror KVCacheManager) ----------------------------------------
class AddRequest(_Op, tag="add"):
    """A new request: its prompt token ids, or the full-block hashes the
    client computed plus the token count.

    With token ids, `mm_features` (offset, length, identifier per item) and
    `prompt_embeds` (raw rows, one per prompt token; `prompt` may then be
    None and `num_tokens` the row count: the ids are zeros) become extra
    keys of the block hashes, as vLLM's.  `num_prompt_tokens` > 0 says that
    only the first that many of `prompt` were the prompt and the rest were
    appended later (a client restoring a request after a coordinator
    restart sends it so, and its blocks hash as they did)."""

    req: str
    prompt: list[int] | None = None
    block_hashes: list[bytes] | None = None
    num_tokens: int = 0
    lora_name: str | None = None
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False
    mm_features: list[MultiModalFeature] | None = None
    prompt_embeds: bytes | None = None
    num_prompt_tokens: int = 0
    # The LoRA adapter's path: vLLM 0.32 hashes it with the name (a pool of
    # its semantics needs it for a LoRA request's token ids).
    lora_path: str | None = None


def add_request(req: str, prompt=None, block_hashes=None, num_tokens: int = 0,
                lora_name: str | None = None, cache_salt: str | None = None,
                skip_reading_prefix_cache: bool = False, mm_features=None,
                prompt_embeds=None, lora_path: str | None = None) -> AddRequest:
    """The AddRequest the clients' `add_request` sends: `prompt` any
    iterable of ids, `mm_features` (offset, length, identifier) triples,
    `prompt_embeds` any buffer (one row per prompt token; a 2-D array
    gives the token count when `prompt` is None).  Malformed items or
    embeds raise `BadMultimodalInput` here, before anything is sent."""
    prompt = None if prompt is None else list(prompt)
    if prompt_embeds is not None:
        prompt_embeds, row_bytes = embeds_rows(
            prompt_embeds, len(prompt) if prompt is not None else (num_tokens or None))
        if prompt is None:
            num_tokens = len(prompt_embeds) // row_bytes
    if mm_features:
        n = len(prompt) if prompt is not None else num_tokens
        mm_features = list(check_mm_features(mm_features, n))
    return AddRequest(req, prompt, block_hashes, num_tokens, lora_name, cache_salt,
                      skip_reading_prefix_cache, mm_features or None, prompt_embeds,
                      lora_path=lora_path)


class Advance(_Op, tag="advance"):
    """Scheduler bookkeeping: set num_computed_tokens, append tokens (or the
    hashes of newly completed blocks plus the new token count)."""

    req: str
    num_computed_tokens: int
    append: list[int] = []
    append_hashes: list[bytes] = []
    num_appended: int = 0


class GetComputedBlocks(_Op, tag="hits"):
    req: str
    # A lookup finding this many tokens in flight or more is not counted in
    # the pool's prefix-cache stats: the engine holds the request back and
    # looks it up again (0: counted; KVCacheManagerCore.get_computed_blocks).
    hold_at: int = 0


class AllocateSlots(_Op, tag="alloc"):
    req: str
    num_new_tokens: int
    num_new_computed_tokens: int = 0
    use_computed_blocks: bool = False
    num_lookahead_tokens: int = 0
    num_external_computed_tokens: int = 0
    delay_cache_blocks: bool = False
    num_encoder_tokens: int = 0
    # vLLM 0.32's admission (pools of its semantics; core/semantics.py): the
    # request comes from the waiting queue; admit it only if its whole
    # sequence fits; whether other requests run (the watermark applies).
    full_sequence_must_fit: bool = False
    waiting: bool = False
    has_scheduled_reqs: bool = True
    # Blocks to leave free after the allocation (vLLM 0.32 holds them back
    # for asynchronous KV loads in flight).
    reserved_blocks: int = 0


class Admit(_Op, tag="admit"):
    """Admit a waiting request in one step, as a scheduler does: look up its
    prefix-cache hits, then allocate slots for min(max_new_tokens, the
    tokens not hit) new tokens on top of them.  Atomic, so no other worker
    can evict a hit between the lookup and the allocation.

    `wait_in_flight` > 0: when at least that many tokens past the hit are
    in flight (other sessions are writing their blocks now), allocate
    nothing and say so (`Admitted.num_in_flight_tokens`), so the request
    can wait for them instead of computing them again."""

    req: str
    max_new_tokens: int
    num_lookahead_tokens: int = 0
    delay_cache_blocks: bool = False
    wait_in_flight: int = 0


class CacheBlocks(_Op, tag="cache"):
    req: str
    num_computed_tokens: int


class Free(_Op, tag="free"):
    req: str
    preempted: bool = False


class RemoveSkippedBlocks(_Op, tag="skip"):
    req: str
    total_computed_tokens: int


class GetBlockIds(_Op, tag="ids"):
    req: str


class NumCommonPrefixBlocks(_Op, tag="common"):
    req: str


class NewStepStarts(_Op, tag="step"):
    """A scheduler step begins (vLLM 0.32 says so to its manager)."""


class EstimateCachedTokens(_Op, tag="cached_tokens"):
    """Tokens request `req`'s cached blocks cover (`CachedTokens`), as vLLM
    0.32 asks at a request's first output."""

    req: str


class ResetPrefixCache(_Op, tag="reset"):
    pass


class EvictBlocks(_Op, tag="evict"):
    block_ids: list[int]


class GetStats(_Op, tag="stats"):
    free_head: int = 0   # also return this many free-queue ids (eviction order)


class TakeEvents(_Op, tag="take_events"):
    """The KV-cache events this session's frames caused since its last
    TakeEvents (the first one starts the recording), as a vLLM engine's
    `take_events()` returns its manager's."""


class ReportCorrupt(_Op, tag="corrupt"):
    """Blocks of request `req` whose K/V its engine found wrong when it read
    them (prefix-cache hits that differ from a recompute): the coordinator
    uncaches them and every cached block whose chain runs through them, so
    no later lookup hits them (`Uncached`).  The request must hold each of
    them: a session reports only blocks its requests read."""

    req: str
    block_ids: list[int]


class RestoreHits(_Op, tag="restore_hits"):
    """After a coordinator restart, the prefix-cache lookup request `req`
    got before it (`GetComputedBlocks`' block ids), which a later
    `AllocateSlots(use_computed_blocks=True)` is to use: the coordinator
    looks the request up again (counting no lookup) and keeps the result
    when it finds exactly these blocks (`HitsRestored(True)`).  Otherwise
    the allocation that uses them is refused with STALE_HITS, as the hits no
    longer hold.  The clients send it with the request's restore."""

    req: str
    block_ids: list[list[int]]


OPS = (AddRequest, Advance, GetComputedBlocks, AllocateSlots, Admit, CacheBlocks, Free,
       RemoveSkippedBlocks, GetBlockIds, NumCommonPrefixBlocks, ResetPrefixCache,
       EvictBlocks, GetStats, TakeEvents, ReportCorrupt, RestoreHits, NewStepStarts,
       EstimateCachedTokens)
Op = Union[OPS]


class Batch(_Op, tag="batch"):
    """Several operations in one frame (a scheduler step), executed in order
    with no other session's operation in between; one `BatchReply`."""

    ops: list[Op]


# What a client sends: the handshake, a batch, or one operation.
Message = Union[(Hello, Batch, *OPS)]


# -- replies ------------------------------------------------------------------------------
class Done(_Op, tag="done"):
    """Success without a value (add, advance, cache)."""


class ComputedBlocks(_Op, tag="hits"):
    """A lookup's hits, and the tokens past them that other sessions are
    writing now (they become hits once ready)."""

    block_ids: list[list[int]]
    num_computed_tokens: int
    num_in_flight_tokens: int = 0
    shared_prefix_boundary: int = 0   # vLLM 0.32's third value (0 but on hybrid pools)


class Allocated(_Op, tag="alloc"):
    new_block_ids: list[list[int]] | None   # None: not enough free blocks
    num_free_blocks: int


class Admitted(_Op, tag="admit"):
    """Admit's result: the hits (per group, null blocks included) and the
    hit token count; the new tokens scheduled and their new block ids, or
    None if the pool is short of blocks or the request waits for tokens in
    flight (`num_in_flight_tokens` >= `Admit.wait_in_flight`); the request
    stays unallocated then."""

    hit_block_ids: list[list[int]]
    num_computed_tokens: int
    num_new_tokens: int
    new_block_ids: list[list[int]] | None
    num_free_blocks: int
    num_in_flight_tokens: int = 0


class FreeBlocks(_Op, tag="free"):
    num_free_blocks: int


class BlockIds(_Op, tag="ids"):
    block_ids: list[list[int]]


class CommonPrefix(_Op, tag="common"):
    num_blocks: list[int]


class CachedTokens(_Op, tag="cached_tokens"):
    num_tokens: int


class ResetResult(_Op, tag="reset"):
    ok: bool


class Stats(_Op, tag="stats"):
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    usage: float
    num_requests: int
    num_sessions: int
    queries: int
    hits: int
    query_tokens: int
    hit_tokens: int
    free_head: list[int] = []


class Events(_Op, tag="events"):
    payload: bytes = b""   # msgpack list of kvshm.core.events events (their wire form)
    dropped: int = 0       # events not kept (the session took none for too long)


class Error(_Op, tag="error"):
    code: str
    message: str
    fields: dict[str, Union[int, str]] = {}   # the error class's `fields` (errors.py)


class Shutdown(_Op, tag="shutdown"):
    """Not a reply: the coordinator's last frame on every connection when it
    stops cleanly (its pool is gone with it, so there is nothing to resume)."""

    reason: str = ""


class Uncached(_Op, tag="uncached"):
    """ReportCorrupt's result: every block it uncached, the reported ones
    (those still cached) first, then the blocks computed from them."""

    block_ids: list[int]


class HitsRestored(_Op, tag="restore_hits"):
    """RestoreHits' result: whether the request's lookup was found again."""

    restored: bool


REPLIES = (Done, ComputedBlocks, Allocated, Admitted, FreeBlocks, BlockIds, CommonPrefix,
           ResetResult, Stats, Events, Error, Uncached, HitsRestored, CachedTokens)
Reply = Union[REPLIES]


class BatchReply(_Op, tag="batch"):
    """Per-op replies of a Batch; execution stops at the first error (later
    ops are not run and have no reply)."""

    results: list[Reply]


# What the coordinator sends: the handshake's answer, a reply, or its goodbye.
ServerMessage = Union[(Welcome, BatchReply, *REPLIES, Shutdown)]
