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
import math
import os
import time
from typing import Protocol

from kvshm.core.errors import ConfigError, PoolRefused
from kvshm.core.hashing import BlockHasher, VLLM_HASH_ALGORITHMS
from kvshm.core.specs import PoolConfig, is_pythonhashseed
from kvshm.pool.kv_cache_manager import KVCacheManager
from kvshm.vllm.release import log, vllm_release

EMBEDDED = "embedded"


def embedded_pool_name(pid: int) -> str:
    """The segment of engine process `pid`'s embedded pool (gone with it)."""
    return f"kvshm-vllm-{pid}"


# The seed an embedded pool (and an engine that set none) hashes with: it
# becomes PYTHONHASHSEED, which must be an integer.
DEFAULT_SEED = "0"


class Backend(Protocol):
    """What the vLLM-facing manager needs of a pool (kvshm block ids)."""

    num_blocks: int

    def usage(self) -> float: ...
    def block_hash(self, block_id: int) -> bytes | None: ...
    def get_computed_blocks(self, request) -> tuple[list[list[int]], int, int]: ...
    def holds(self, request_id: str) -> bool: ...
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens, hits,
                       num_lookahead_tokens, num_external_computed_tokens,
                       delay_cache_blocks, num_encoder_tokens,
                       full_sequence_must_fit: bool = False, waiting: bool = False,
                       has_scheduled_reqs: bool = True,
                       reserved_blocks: int = 0) -> list[list[int]] | None: ...
    def estimate_cached_tokens(self, request_id: str) -> int: ...
    def new_step_starts(self) -> None: ...
    def free(self, request) -> None: ...
    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None: ...
    def evict_blocks(self, block_ids: list[int]) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]: ...
    def get_block_ids(self, request_id: str) -> list[list[int]]: ...
    def cache_blocks(self, request, num_computed_tokens: int) -> None: ...
    def start_events(self) -> None: ...
    def take_events(self) -> list: ...
    def close(self) -> None: ...


class EmbeddedBackend:
    """kvshm's core in this process; vLLM's requests go in as they are."""

    def __init__(self, config: PoolConfig) -> None:
        self.manager = m = KVCacheManager(config, name=embedded_pool_name(os.getpid()))
        self.num_blocks = config.num_blocks
        self.block_hash = m.block_pool.block_hash
        self.allocate_slots = m.allocate_slots
        self.estimate_cached_tokens = m.estimate_cached_tokens
        self.new_step_starts = m.new_step_starts
        self.free = m.free
        self.remove_skipped_blocks = m.remove_skipped_blocks
        self.evict_blocks = m.evict_blocks
        self.reset_prefix_cache = m.reset_prefix_cache
        self.get_num_common_prefix_blocks = m.get_num_common_prefix_blocks
        self.get_block_ids = m.get_block_ids
        self.cache_blocks = m.cache_blocks

    def usage(self) -> float:
        return self.manager.usage

    def get_computed_blocks(self, request) -> tuple[list[list[int]], int, int]:
        m = self.manager
        hits, n = m.get_computed_blocks(request)
        return hits, n, m.shared_prefix_boundary

    def holds(self, request_id: str) -> bool:
        return False                 # nothing is in flight on an engine's own pool

    def start_events(self) -> None:
        self.manager.enable_events()

    def take_events(self) -> list:
        return self.manager.take_events()

    def close(self) -> None:
        self.manager.close()


def env_number(name: str, default: float, *, integer: bool = False,
               minimum: float = 0) -> float:
    """The number in environment variable `name` (`default` when it is
    unset or blank).  Raises ConfigError naming the variable unless it is a
    finite number (a whole one with `integer`) of at least `minimum`."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        kind = "a whole number" if integer else "a number"
        raise ConfigError(name, f"{text!r} is not {kind}") from None
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(name, f"must be a finite number >= {minimum:g} (got {text})")
    return value


class PoolBinding:
    """This process's pool: `target` is "embedded" or a coordinator socket.

    A shared pool's settings are read from the environment when the binding
    is made (the engine's start), so a bad one stops the engine there with
    its name: KVSHM_CONNECT_TIMEOUT (seconds, 30), KVSHM_NODE (the NUMA node
    the session reports, -1: none), KVSHM_WAIT_IN_FLIGHT (tokens, 128; 0:
    never wait) and KVSHM_IN_FLIGHT_DEADLINE (seconds, 2)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.embedded = target == EMBEDDED
        if not self.embedded:
            self.connect_timeout = env_number("KVSHM_CONNECT_TIMEOUT", 30.0)
            self.node = env_number("KVSHM_NODE", -1, integer=True, minimum=-1)
            self.wait_in_flight = env_number("KVSHM_WAIT_IN_FLIGHT", 128, integer=True)
            self.in_flight_deadline = env_number("KVSHM_IN_FLIGHT_DEADLINE", 2.0)
        self.engine_config = None    # vLLM's VllmConfig, set by the scheduler patch
        self.backend: Backend | None = None
        self.backend_hasher: BlockHasher | None = None
        self.client = None           # shared pools: the SyncClient
        self.arena = None            # shared pools: the KV arena the engine computes into

    # -- hashing -----------------------------------------------------------------
    def engine_hashing(self, vllm_config, pool_algorithm: str | None,
                       pool_seed: str | None) -> tuple[str, str]:
        """The (kvshm algorithm, seed) this engine hashes with, after making
        it the pool's: an engine without PYTHONHASHSEED gets the pool's seed
        (vLLM would pick a random one, and no two engines would ever share).
        Raises PoolRefused when the engine's algorithm or explicit seed is
        not the pool's."""
        vllm_algo = vllm_config.cache_config.prefix_caching_hash_algo
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
        if pool_seed is not None and not is_pythonhashseed(pool_seed):
            raise PoolRefused(
                f"the pool hashes with seed {pool_seed!r}, which no vLLM engine can use (its "
                "PYTHONHASHSEED must be an integer in [0, 4294967295]): serve the pool with "
                "--hash-seed N")
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

    def engine_started(self) -> None:
        """The engine core is built: vLLM has derived the parent hash of
        block 0, which must be the pool's (else no block this engine hashes
        would ever match)."""
        if self.backend_hasher is None:
            return
        from vllm.v1.core import kv_cache_utils
        h = self.backend_hasher
        if kv_cache_utils.NONE_HASH != h.none_hash:
            raise PoolRefused(
                "the engine's block hashes start from another seed than the pool's "
                f"({h.algorithm}, seed {h.seed!r}): PYTHONHASHSEED changed after the engine "
                "started, or another plugin set it")

    # -- shared pools: the coordinator, the engine's size and its KV tensors ------------
    def connect(self):
        """The session with the coordinator (opened on first use).  An engine
        started beside its coordinator waits for it to listen, up to
        KVSHM_CONNECT_TIMEOUT seconds (30)."""
        if self.client is None:
            from kvshm.ops.errors import ConnectionLost, RequestTimeout
            from kvshm.service.handshake import default_socket_path
            from kvshm.service.sync_client import connect_sync
            from kvshm.service.tenant_auth import read_token_file
            t = self.target
            path = t if ("/" in t or t.endswith(".sock")) else default_socket_path(t)
            token_file = os.environ.get("KVSHM_TENANT_TOKEN_FILE")
            # (read once, and refused unless private, as the coordinator reads its own)
            tenant_token = read_token_file(token_file) if token_file else None
            deadline = time.monotonic() + self.connect_timeout
            while True:
                try:
                    self.client = connect_sync(
                        path, hash_algorithm=None, tenant=os.environ.get("KVSHM_TENANT", ""),
                        node=self.node,
                        admin=os.environ.get("KVSHM_ADMIN") == "1", tenant_token=tenant_token,
                        vllm_version=vllm_release())
                    break
                except (ConnectionLost, RequestTimeout):
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.1)
            atexit.register(self.close)
            log.info("kvshm: engine %d on pool %s (session %d, %d blocks)", os.getpid(), path,
                     self.client.session_id, self.client.config.num_blocks)
        return self.client

    def size_engine(self, vllm_config) -> None:
        """Before vLLM sizes its KV cache: the engine must fit the pool
        (block size, context, hashing), and gets the pool's block count."""
        from kvshm.vllm.specs import engine_differences
        pool = self.connect().config
        problems = engine_differences(pool, vllm_config)
        if problems:
            raise PoolRefused(_refusal(self.target, problems))
        self.engine_hashing(vllm_config, pool.hash_algorithm, pool.hash_seed)
        vllm_config.cache_config.num_gpu_blocks_override = pool.num_blocks

    def checked_arena(self, kv_cache_config):
        """The pool's arena, once the engine's KV-cache config is found to
        fit it (else PoolRefused, the differences named)."""
        from kvshm.vllm.specs import arena_differences
        client = self.connect()
        problems = arena_differences(client.config, kv_cache_config)
        if problems:
            raise PoolRefused(_refusal(self.target, problems))
        if self.arena is None:
            self.arena = client.attach_arena()
        return self.arena

    def kv_cache_tensors(self, runner, kv_cache_config) -> dict:
        """vLLM 0.14: the engine's raw KV-cache tensors (vLLM reshapes them
        per layer): views of the pool's arena, so every engine computes
        into, and reads hits from, the same bytes."""
        import torch
        arena = self.checked_arena(kv_cache_config)
        layout, buf = arena.layout, arena.buffer
        raw = {}
        for i, t in enumerate(kv_cache_config.kv_cache_tensors):
            offset, size = layout.layer_region(i)
            tensor = torch.frombuffer(buf, dtype=torch.int8, count=size, offset=offset)
            for name in t.shared_by:
                raw[name] = tensor
        return raw

    def kv_cache_views(self, kv_cache_config, device, layout,
                       kernel_block_sizes: list[int] | None = None) -> dict:
        """vLLM 0.32: the engine's per-layer KV-cache views (vLLM's own
        views of its one backing allocation, which is the pool arena's data),
        so every engine computes into, and reads hits from, the same bytes."""
        import torch
        from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views
        arena = self.checked_arena(kv_cache_config)
        size = kv_cache_config.kv_cache_tensors[0].size
        raw = torch.frombuffer(arena.buffer, dtype=torch.int8, count=size,
                               offset=arena.layout.data_offset)
        views = {}
        groups = kv_cache_config.kv_cache_groups
        for tensor in kv_cache_config.kv_cache_tensors:
            gid = next(g for g, group in enumerate(groups)
                       if tensor.layers[0] in group.layer_names)
            spec = groups[gid].kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[tensor.layers[0]]
            kernel = (kernel_block_sizes[gid] if kernel_block_sizes is not None
                      and gid < len(kernel_block_sizes) else None)
            views.update(zip(tensor.layers, create_kv_cache_views(
                raw, spec, kv_cache_config.num_blocks_of(tensor), layout, tensor,
                kernel_block_size=kernel)))
        return views

    def gate_scheduler(self, scheduler) -> None:
        """On a shared pool, give the engine's scheduler the plugin's KV
        connector (gate.py), so that a request waiting for tokens another
        engine is computing is skipped, not a block on the whole queue;
        unless the engine has a connector of its own or never waits.

        On vLLM 0.32 an engine's own connector that loads K/V (a consumer)
        is refused: its asynchronous loads would have the scheduler size
        the blocks held for them through the manager's coordinator, which
        the plugin does not reproduce."""
        own = scheduler.connector
        if own is not None and vllm_release() != "0.14.0":
            transfer = scheduler.vllm_config.kv_transfer_config
            if transfer.is_kv_consumer or own.supports_divergent_local_hybrid_hits:
                raise PoolRefused(
                    f"this engine's KV connector ({type(own).__name__}) loads K/V into the "
                    f"cache, which kvshm pools do not support on vLLM {vllm_release()}: "
                    "run it without KVSHM_POOL, or with a connector that only saves")
        backend = self.backend
        if self.embedded or backend is None or not backend.wait_in_flight:
            return
        if scheduler.connector is not None:
            log.info("kvshm: the engine has its own KV connector (%s): a request waiting "
                     "for tokens in flight holds the waiting queue behind it",
                     type(scheduler.connector).__name__)
            return
        from kvshm.vllm.gate import InFlightGate
        scheduler.connector = InFlightGate(backend)

    def step_computed(self, scheduler_output) -> None:
        """A step's forward pass is done: its K/V are in the arena."""
        if self.backend is not None and not self.embedded:
            self.backend.step_computed(scheduler_output.num_scheduled_tokens)

    # -- backends ------------------------------------------------------------------
    def open_backend(self, kv_cache_config, *, max_model_len: int, hash_block_size: int,
                     enable_caching: bool, use_eagle: bool, dcp_world_size: int,
                     pcp_world_size: int, release: dict | None = None) -> Backend:
        """The backend of the scheduler's manager (one per process).
        `release`: the pool config's keys the engine's release sets
        (`vllm_version`, and 0.32's `watermark` and `max_in_flight_tokens`)."""
        from kvshm.vllm.specs import config_differences, pool_config
        if self.engine_config is None:
            raise ConfigError("KVSHM_POOL", "the kvshm plugin's scheduler patch did not run")
        if self.backend is not None:
            raise ConfigError("KVSHM_POOL", "one kvshm pool manager per engine process")
        shape = dict(max_model_len=max_model_len, hash_block_size=hash_block_size,
                     enable_caching=enable_caching, use_eagle=use_eagle,
                     dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
                     **(release or {}))
        if self.embedded:
            algo, seed = self.engine_hashing(self.engine_config, None, None)
            config = pool_config(
                kv_cache_config, **shape,
                max_num_seqs=2 * self.engine_config.scheduler_config.max_num_seqs,
                hash_algorithm=algo, hash_seed=seed)
            backend = EmbeddedBackend(config)
            log.info("kvshm: embedded pool %s, %d blocks", backend.manager.segment.name,
                     config.num_blocks)
            self.backend_hasher = backend.manager.make_hasher()
        else:
            from kvshm.vllm.remote import RemoteBackend
            client = self.connect()
            pool = client.config
            algo, seed = self.engine_hashing(self.engine_config, pool.hash_algorithm,
                                             pool.hash_seed)
            engine = pool_config(kv_cache_config, **shape, max_num_seqs=pool.max_num_seqs,
                                 hash_algorithm=algo, hash_seed=seed)
            problems = config_differences(pool, engine)
            if kv_cache_config.num_blocks != pool.num_blocks:
                problems.append(f"num_blocks: pool {pool.num_blocks}, engine "
                                f"{kv_cache_config.num_blocks}")
            if problems:
                raise PoolRefused(_refusal(self.target, problems))
            backend = RemoteBackend(client, wait_in_flight=self.wait_in_flight,
                                    in_flight_deadline=self.in_flight_deadline)
            self.backend_hasher = client.make_hasher()
        self.backend = backend
        atexit.register(self.close)
        return backend

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None
        if self.client is not None:
            self.client.close()
            self.client = None


def _refusal(target: str, problems: list[str]) -> str:
    return (f"this engine does not fit the kvshm pool at {target!r}: " + "; ".join(problems)
            + " (serve the pool for this model: kvshm serve --vllm-model DIR "
            "--block-size N, and start the engine with the same block size)")


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
