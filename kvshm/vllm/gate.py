"""The scheduler's KV connector on a shared pool: it holds back only the
waiting requests whose prefix another engine is computing.

vLLM 0.14's scheduler asks a KV connector, for each waiting request it
looks up, how many more tokens of the request it can supply; an answer of
None means "not known yet": the scheduler skips that request this step and
goes on with the ones behind it.  The gate answers None for a request that
waits for tokens in flight (`RemoteBackend.waits`) and 0 otherwise, so a
waiting request no longer holds the whole queue the way a failed
allocation does: the engine computes other prompts meanwhile (often
another document, which the other engines then hit).

It moves no K/V (no worker side: the workers never see it) and keeps no
blocks after a request ends.  A step in which the scheduler found nothing
to run while requests wait sleeps until their next lookup is due
(`RemoteBackend.idle`), so the engine loop does not spin through empty
steps.  The plugin installs the gate when the engine has no connector of
its own (`PoolBinding.gate_scheduler`); with one, a waiting request's
allocation answers None instead.  Runs inside vLLM processes only.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, SupportsHMA


class _NoTransfers(KVConnectorMetadata):
    """A step's metadata for the workers: nothing to load or save."""


class InFlightGate(SupportsHMA):
    """The scheduler-side connector calls vLLM 0.14 and 0.32 make, over the
    pool's backend (see the module doc)."""

    # 0.32 asks these of every connector: the gate loads nothing, so local
    # hits are all there is, no request's delivery depends on it, and it
    # never holds blocks or work back.
    supports_divergent_local_hybrid_hits = False
    requires_kv_delivery = False

    def __init__(self, backend) -> None:
        self.backend = backend
        backend.skips_waiting = True

    def on_new_request(self, request) -> None:
        pass

    def has_pending_block_frees(self) -> bool:
        return False

    def has_pending_push_work(self) -> bool:
        return False

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return ()

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if self.backend.waits(request.request_id):
            self.backend.in_flight_skips += 1
            return None, False
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self.backend.idle(scheduler_output.total_num_scheduled_tokens)
        return _NoTransfers()

    def update_connector_output(self, connector_output) -> None:
        pass

    def request_finished(self, request, block_ids):
        return False, None          # free the blocks now; nothing to send anywhere

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def take_events(self):
        return ()

    def get_kv_connector_stats(self):
        return None

    def reset_cache(self) -> bool:
        return True                 # it caches nothing of its own

    def shutdown(self) -> None:
        pass
