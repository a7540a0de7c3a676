"""Where the plugin hooks into vLLM 0.14 and 0.32 (installed once per
process by `kvshm.vllm.register` when KVSHM_POOL is set):

- the scheduler's `KVCacheManager` is kvshm's manager of the engine's
  release (`manager.MANAGERS`), and `Scheduler.__init__` hands the engine's
  config to the process's binding first;
- `EngineCore.__init__` checks, once vLLM has derived it, that the parent
  hash of block 0 is the pool's;
- shared pools only: the engine's block count is the pool's
  (`EngineCore._initialize_kv_caches`), the KV-cache tensors are views of
  the pool's arena (0.14: `GPUModelRunner._allocate_kv_cache_tensors`,
  which the CPU model runner inherits; 0.32: the `allocate_kv_cache` the
  model runner module imports), a step's computed blocks become hits for the
  other engines once its forward pass wrote their K/V
  (`Scheduler.update_from_output`), and the scheduler gets the plugin's KV
  connector (`gate.py`) if it has none, once the engine core is built.
"""

from __future__ import annotations

import functools

_installed = False


def install() -> None:
    """Patch vLLM's scheduler, engine core and model runner (idempotent)."""
    global _installed
    if _installed:
        return
    from vllm.v1.core.sched import scheduler as sched_mod
    from vllm.v1.engine import core as core_mod

    from kvshm.vllm.binding import current_binding
    from kvshm.vllm.manager import MANAGERS
    from kvshm.vllm.release import vllm_release

    binding = current_binding()
    release = vllm_release()
    sched_mod.KVCacheManager = MANAGERS[release]
    Scheduler = sched_mod.Scheduler

    init = Scheduler.__init__

    @functools.wraps(init)
    def scheduler_init(self, vllm_config, *args, **kwargs):
        binding.engine_config = vllm_config
        init(self, vllm_config, *args, **kwargs)

    Scheduler.__init__ = scheduler_init

    EngineCore = core_mod.EngineCore
    core_init = EngineCore.__init__

    @functools.wraps(core_init)
    def engine_core_init(self, *args, **kwargs):
        core_init(self, *args, **kwargs)
        binding.engine_started()
        # After the engine core's own connector set-up, which the gate needs
        # none of (it has no worker side).
        binding.gate_scheduler(self.scheduler)

    EngineCore.__init__ = engine_core_init

    if not binding.embedded:
        from vllm.v1.worker import gpu_model_runner as runner_mod
        runner = runner_mod.GPUModelRunner

        init_kv = EngineCore._initialize_kv_caches

        @functools.wraps(init_kv)
        def initialize_kv_caches(self, vllm_config):
            binding.size_engine(vllm_config)
            return init_kv(self, vllm_config)

        EngineCore._initialize_kv_caches = initialize_kv_caches

        if release == "0.14.0":
            @functools.wraps(runner._allocate_kv_cache_tensors)
            def allocate_kv_cache_tensors(self, kv_cache_config):
                return binding.kv_cache_tensors(self, kv_cache_config)

            runner._allocate_kv_cache_tensors = allocate_kv_cache_tensors
        else:
            @functools.wraps(runner_mod.allocate_kv_cache)
            def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
                return binding.kv_cache_views(kv_cache_config, device, layout,
                                              kernel_block_sizes)

            runner_mod.allocate_kv_cache = allocate_kv_cache

        update = Scheduler.update_from_output

        @functools.wraps(update)
        def update_from_output(self, scheduler_output, model_runner_output):
            binding.step_computed(scheduler_output)
            return update(self, scheduler_output, model_runner_output)

        Scheduler.update_from_output = update_from_output
    _installed = True
