"""The engine process's link to its pool, as `KVSHM_POOL` says:

- `embedded`: kvshm's allocator core in this process, its state in a
  shared-memory segment of its own (vLLM's behaviour exactly);
- a socket path or pool name: a session with a running coordinator (the
  blocks, the prefix cache and the K/V bytes shared with other engines).

One binding per process (`current_binding()`); the patched scheduler hands
it the engine's config, the manager opens its backend through it.  Runs
inside vLLM processes only.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import Protocol

from kvshm.core.errors import ConfigError, PoolRefused
from kvshm.core.hashing import BlockHasher, VLLM_HASH_ALGORITHMS
from kvshm.core.manager import KVCacheManager
from kvshm.core.specs import PoolConfig

log = logging.getLogger("kvshm.vllm")

EMBEDDED = "embedded"
# The seed an embedded pool (and an engine that set none) hashes with.
DEFAULT_SEED = "kvshm-0"


class Backend(Protocol):
    """What the vLLM-facing manager needs of a pool (kvshm block ids)."""

    num_blocks: int

    def usage(self) -> float: ...
    def block_hash(self, block_id: int) -> bytes | None: ...
    def get_computed_blocks(self, request) -> tuple[list[list[int]], int]: ...
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens, hits,
                       num_lookahead_tokens, num_external_computed_tokens,
                       delay_cache_blocks, num_encoder_tokens) -> list[list[int]] | None: ...
    def free(self, request) -> None: ...
    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None: ...
    def evict_blocks(self, block_ids: list[int]) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]: ...
    def get_block_ids(self, request_id: str) -> list[list[int]]: ...
    def cache_blocks(self, request, num_computed_tokens: int) -> None: ...
    def close(self) -> None: ...


class EmbeddedBackend:
    """kvshm's core in this process; vLLM's requests go in as they are."""

    def __init__(self, config: PoolConfig) -> None:
        self.manager = m = KVCacheManager(config, name=f"kvshm-vllm-{os.getpid()}")
        self.num_blocks = config.num_blocks
        self.block_hash = m.block_pool.block_hash
        self.get_computed_blocks = m.get_computed_blocks
        self.allocate_slots = m.allocate_slots
        self.free = m.free
        self.remove_skipped_blocks = m.remove_skipped_blocks
        self.evict_blocks = m.evict_blocks
        self.reset_prefix_cache = m.reset_prefix_cache
        self.get_num_common_prefix_blocks = m.get_num_common_prefix_blocks
        self.get_block_ids = m.get_block_ids
        self.cache_blocks = m.cache_blocks

    def usage(self) -> float:
        return self.manager.usage

    def close(self) -> None:
        self.manager.close()


class PoolBinding:
    """This process's pool: `target` is "embedded" or a coordinator socket."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.embedded = target == EMBEDDED
        self.engine_config = None    # vLLM's VllmConfig, set by the scheduler patch
        self.backend: Backend | None = None
        self.backend_hasher: BlockHasher | None = None

    # -- hashing -----------------------------------------------------------------
    def engine_hashing(self, pool_algorithm: str | None, pool_seed: str | None) -> tuple[str, str]:
        """The (kvshm algorithm, seed) this engine hashes with, after making
        it the pool's: an engine without PYTHONHASHSEED gets the pool's seed
        (vLLM would pick a random one, and no two engines would ever share).
        Raises PoolRefused when the engine's algorithm or explicit seed is
        not the pool's."""
        vllm_algo = self.engine_config.cache_config.prefix_caching_hash_algo
        algo = next((k for k, v in VLLM_HASH_ALGORITHMS.items() if v == vllm_algo), None)
        if algo is None:
            raise PoolRefused(
                f"the engine hashes prefix-cache blocks with {vllm_algo!r}; kvshm reproduces "
                "vLLM's 'sha256' and 'sha256_cbor': start the engine with "
                "prefix_caching_hash_algo='sha256'")
        if pool_algorithm is not None and algo != pool_algorithm:
            want = VLLM_HASH_ALGORITHMS.get(pool_algorithm)
            fix = (f"start the engine with prefix_caching_hash_algo={want!r}" if want else
                   f"serve the pool with --hash-algorithm {algo} (it hashes with kvshm's "
                   f"own {pool_algorithm!r}, which no vLLM engine computes)")
            raise PoolRefused(f"the engine hashes with {vllm_algo!r} (kvshm {algo!r}), the "
                              f"pool with {pool_algorithm!r}: {fix}")
        seed = os.environ.get("PYTHONHASHSEED")
        want_seed = pool_seed if pool_seed is not None else DEFAULT_SEED
        if seed is None:
            os.environ["PYTHONHASHSEED"] = want_seed   # read by vLLM's init_none_hash
            seed = want_seed
        elif pool_seed is not None and seed != pool_seed:
            raise PoolRefused(
                f"the engine's PYTHONHASHSEED is {seed!r}, the pool's hash seed {pool_seed!r}: "
                f"unset PYTHONHASHSEED (the plugin then uses the pool's) or set it to "
                f"{pool_seed!r}")
        return algo, seed

    def check_none_hash(self, hasher: BlockHasher) -> None:
        """After vLLM derived its parent hash of block 0: it must be the
        pool's (else no block this engine hashes would ever match)."""
        from vllm.v1.core import kv_cache_utils
        got = kv_cache_utils.NONE_HASH
        if got != hasher.none_hash:
            raise PoolRefused(
                "the engine's block hashes start from a different seed than the pool's "
                f"({hasher.algorithm}, seed {hasher.seed!r}): PYTHONHASHSEED changed after "
                "the engine started, or another plugin set it")

    def engine_started(self) -> None:
        """The engine core is built (vLLM has derived its hash seed)."""
        if self.backend is not None and self.backend_hasher is not None:
            self.check_none_hash(self.backend_hasher)

    # -- backends ------------------------------------------------------------------
    def open_backend(self, kv_cache_config, *, max_model_len: int, hash_block_size: int,
                     enable_caching: bool, use_eagle: bool, dcp_world_size: int,
                     pcp_world_size: int) -> Backend:
        """The backend of the scheduler's manager (one per process)."""
        from kvshm.vllm.specs import pool_config
        if self.engine_config is None:
            raise ConfigError("KVSHM_POOL", "the kvshm plugin's scheduler patch did not run")
        if self.backend is not None:
            raise ConfigError("KVSHM_POOL", "one kvshm pool manager per engine process")
        sched = self.engine_config.scheduler_config
        if self.embedded:
            algo, seed = self.engine_hashing(None, None)
            config = pool_config(
                kv_cache_config, max_model_len=max_model_len,
                hash_block_size=hash_block_size, enable_caching=enable_caching,
                use_eagle=use_eagle, dcp_world_size=dcp_world_size,
                pcp_world_size=pcp_world_size, max_num_seqs=2 * sched.max_num_seqs,
                hash_algorithm=algo, hash_seed=seed)
            self.backend = EmbeddedBackend(config)
            atexit.register(self.close)
            self.backend_hasher = self.backend.manager.make_hasher()
            log.info("kvshm: embedded pool %s, %d blocks", self.backend.manager.segment.name,
                     config.num_blocks)
            return self.backend
        raise ConfigError("KVSHM_POOL", f"{self.target!r}: shared pools come with the sync client")

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None


_binding: PoolBinding | None = None


def current_binding() -> PoolBinding:
    """This process's binding (made from KVSHM_POOL on first use)."""
    global _binding
    if _binding is None:
        target = os.environ.get("KVSHM_POOL", "").strip()
        if not target:
            raise ConfigError("KVSHM_POOL", "not set: the kvshm plugin is off")
        _binding = PoolBinding(target)
    return _binding
