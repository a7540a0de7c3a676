"""Which vLLM release's allocation semantics a pool reproduces.

A pool names its release (`PoolConfig.vllm_version`, "0.14.0" unless
told), and the core reproduces that release's KV-cache manager.  Where two
releases differ, the difference is one attribute of the release's
`Semantics` here, read by the one place in the core that acts on it
(named per attribute), or, where a whole algorithm differs, a class of
the release's: its per-type managers (`RELEASE_MANAGERS`,
core/release_managers.py) and its hybrid logic (`HYBRID_LOGIC`,
core/group_logic.py).  Nothing else in the core asks which release a pool
is.  docs/vllm.md ("vLLM 0.32 against 0.14") lists what differs and why.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_VLLM_VERSION = "0.14.0"


@dataclass(frozen=True)
class Semantics:
    """One release's answers where releases differ.

    version: the release ("0.14.0").
    lifo_unhashed_free: a freed block without a hash (every freed block,
        with caching off) goes to the head of the free queue, to be reused
        first; hashed ones join the tail as before (`BlockPool.free_blocks`).
        0.14 appends every freed block to the tail.
    admission_gate: `allocate_slots` honours `full_sequence_must_fit` (a
        waiting request is admitted only if blocks for its whole sequence
        are free) and the pool's `watermark` (blocks kept free when a
        waiting request is admitted while others run)
        (`KVCacheManagerCore.allocate_slots`).
    allocates_without_new_tokens: `allocate_slots` takes 0 new tokens when
        the call adopts computed tokens (hits or external ones); 0.14 wants
        new or external tokens.
    stats_at_admission: prefix-cache queries and hits are counted when a
        waiting request that looked up is admitted (its allocation
        succeeded), with the hits it used; 0.14 counts every lookup
        (`KVCacheManagerCore.get_computed_blocks` / `allocate_slots`).
    common_prefix_blocks: `get_num_common_prefix_blocks` counts the blocks
        every running request shares (cascade attention); 0.32 removed
        cascade attention and answers zeros.
    event_maps: KV events are msgpack maps (the first key "type") whose
        stored blocks name their group, its spec kind and window, and each
        block's extra keys; the replay socket sends the topic too
        (kvshm/core/events.py, kvshm/service/events.py).  0.14 sends
        positional arrays.
    tagged_extra_keys: `vllm-sha256` block hashes take 0.32's extra keys:
        tagged tuples (`("lora", name, path)`, `("mm", identifier, offset in
        the block)`, `("cache_salt", salt)`, `("prompt_embeds", sha256 of
        the block's rows)`), each multimodal item named by exactly the
        blocks it overlaps (kvshm/core/extra_keys.py).  0.14's are untagged,
        with its walk's quirks.
    partial_entries: a full-attention (or MLA) group whose blocks span
        several hash blocks, in a hybrid pool, also caches the prefix a
        request's prompt ends at inside a block, as a *partial entry* of
        that block (`PoolConfig.partial_entry_groups`,
        `PartialEntryFullManager` in core/release_managers.py, the block
        pool's "Partial entries"): no lookup takes it, but it has KV events
        of its own and makes a freed block count as hashed.
    eagle_windows_of_any_block_size: with EAGLE, a hybrid pool's sliding
        window may have blocks smaller than the lcm of the block sizes
        (`PoolConfig` refuses them on 0.14, whose manager asserts that an
        aligned hit and EAGLE do not go together).
    group_types: the KV-cache group types (`type` of a group spec) a pool
        of the release may have: those whose managers kvshm reproduces op
        for op for it, per its recorded conformance set
        (`PoolConfig` refuses the others, with `missing_types`' reason).
    missing_types: why a type is not in `group_types`.
    """

    version: str
    lifo_unhashed_free: bool
    admission_gate: bool
    allocates_without_new_tokens: bool
    stats_at_admission: bool
    common_prefix_blocks: bool
    event_maps: bool
    tagged_extra_keys: bool
    partial_entries: bool
    eagle_windows_of_any_block_size: bool
    group_types: frozenset[str]
    missing_types: dict[str, str]


ALL_TYPES = frozenset(("full", "mla", "sink_full", "sliding_window", "chunked_local", "mamba",
                       "cross_attention"))
RELEASES: dict[str, Semantics] = {
    "0.14.0": Semantics("0.14.0", lifo_unhashed_free=False, admission_gate=False,
                        allocates_without_new_tokens=False, stats_at_admission=False,
                        common_prefix_blocks=True, event_maps=False,
                        tagged_extra_keys=False, partial_entries=False,
                        eagle_windows_of_any_block_size=False, group_types=ALL_TYPES,
                        missing_types={}),
    "0.32.0": Semantics(
        "0.32.0", lifo_unhashed_free=True, admission_gate=True,
        allocates_without_new_tokens=True, stats_at_admission=True,
        common_prefix_blocks=False, event_maps=True, tagged_extra_keys=True,
        partial_entries=True, eagle_windows_of_any_block_size=True,
        group_types=frozenset(("full", "mla", "chunked_local", "cross_attention",
                               "sliding_window", "mamba")),
        missing_types={
            "sink_full": "vLLM 0.32.0 cannot build its own sink-attention manager (its "
                         "constructor does not take what its coordinator passes), so no "
                         "0.32 engine runs such a model",
        }),
}
VLLM_VERSIONS = tuple(RELEASES)


def semantics(version: str) -> Semantics:
    """The semantics of release `version` (one of `VLLM_VERSIONS`)."""
    return RELEASES[version]
