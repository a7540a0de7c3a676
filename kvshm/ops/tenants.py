"""Tenants: their quotas, their share of the pool, and their own request ids.

A session names its tenant in its Hello.  Each tenant has a slot in the
segment's metrics region (kvshm/core/metrics.py) that counts the blocks it
holds now and its prefix-cache lookups and hits, so `kvshm metrics`, `kvshm
top` and `kvshm stats` show per-tenant usage without asking the coordinator.

Blocks held: tenants never share blocks (their cache keys live in separate
namespaces, docs/service.md), and a frame runs for one session, so the
change of the pool's free-block count over a frame is exactly the change of
that session's tenant's holdings.  A quota caps them: before each frame the
coordinator tells the manager how many free blocks the frame must leave
(`KVCacheManager.free_floor`), so an allocation beyond the quota fails as it
would on a full pool (the tenant's scheduler preempts its own requests);
other tenants are untouched.

Request ids are scoped: a tenant other than the default one ("") has its
ids prefixed by its slot number and U+001F inside the coordinator, so two
tenants may use the same ids and neither can learn the other's from a
DuplicateRequest, NotOwner or UnknownRequest reply.  Clients never see the
prefix; ids containing U+001F are refused.
"""

from __future__ import annotations

from kvshm.core.errors import ConfigError, InvalidArgument
from kvshm.core.metrics import (
    TENANT_NAME_BYTES,
    TENANT_OFFSETS,
    TENANT_SLOTS,
    MetricsWriter,
    tenant_name,
    tenant_word,
)
from kvshm.ops.sessions import tenant_digest

SCOPE_MARK = "\x1f"
_BLOCKS, _QUERIES, _HITS, _QUERY_TOKENS, _HIT_TOKENS = (
    TENANT_OFFSETS[f] for f in ("blocks", "queries", "hits", "query_tokens", "hit_tokens"))


def parse_quota(spec: str, usable_blocks: int) -> tuple[str, int]:
    """`NAME=BLOCKS` or `NAME=PERCENT%` (`=N` names the default tenant "")
    as (tenant, blocks).  Raises ConfigError naming what is wrong."""
    name, sep, value = spec.rpartition("=")
    if not sep:
        raise ConfigError("tenant_quota", f"{spec!r} is not NAME=BLOCKS or NAME=PERCENT%")
    problem = tenant_name_problem(name)
    if problem:
        raise ConfigError("tenant_quota", problem)
    try:
        if value.endswith("%"):
            pct = float(value[:-1])
            if not 0 <= pct <= 100:
                raise ValueError
            return name, int(usable_blocks * pct / 100)
        blocks = int(value)
        if blocks < 0:
            raise ValueError
        return name, blocks
    except ValueError:
        raise ConfigError("tenant_quota", f"{spec!r}: the quota must be a block count >= 0 "
                          "or a percentage in 0..100 followed by %") from None


def tenant_name_problem(name: str) -> str | None:
    """Why `name` cannot be a tenant's name (None: it can)."""
    if len(name.encode()) > TENANT_NAME_BYTES or SCOPE_MARK in name:
        return (f"tenant {name[:80]!r}: tenant names are at most {TENANT_NAME_BYTES} bytes "
                "of UTF-8, without U+001F")
    return None


class TenantBook:
    """The coordinator's tenant accounting over `mgr` (its segment's metrics)."""

    def __init__(self, mgr, metrics: MetricsWriter, quotas: dict[str, int] | None = None) -> None:
        self.mgr = mgr
        self._pool = mgr.block_pool
        self.metrics = metrics
        self._words = metrics.words
        self.quotas = dict(quotas or {})
        self._slots: dict[str, int] = {}
        self._by_digest: dict[bytes, tuple[str, int]] = {}   # session records name digests
        for name in self.quotas:          # quotas show before their tenant connects
            self.slot(name)

    def slot(self, tenant: str) -> int | None:
        """Tenant `tenant`'s slot (None: TENANT_SLOTS tenants exist already)."""
        slot = self._slots.get(tenant)
        if slot is None:
            slot = self.metrics.tenant_slot(tenant)
            if slot is None:
                return None
            self._remember(tenant, slot)
            self.metrics.tenant_set(slot, "quota", self.quotas.get(tenant, -1))
        return slot

    def _remember(self, tenant: str, slot: int) -> None:
        self._slots[tenant] = slot
        self._by_digest[tenant_digest(tenant)] = (tenant, slot)

    def by_digest(self, digest: bytes) -> tuple[str, int] | None:
        """(name, slot) of the tenant a session record names by `digest`."""
        return self._by_digest.get(digest)

    @staticmethod
    def scope(tenant: str, slot: int) -> str:
        """The prefix of `tenant`'s request ids inside the coordinator."""
        return f"{slot}{SCOPE_MARK}" if tenant else ""

    # -- frames -----------------------------------------------------------------------
    # The hot path: two calls a frame, plain attribute and word arithmetic.
    def begin(self, tenant: str, base: int) -> tuple:
        """Before a frame of a session of `tenant` (`base`: its slot's
        `tenant_base`): the pool's counters now, for `end`; sets the floor
        its quota puts under the free blocks."""
        pool = self._pool
        free = pool.num_free_blocks
        if self.quotas:
            quota = self.quotas.get(tenant)
            if quota is None:
                self.mgr.free_floor = 0
            else:
                held = self._words[base + _BLOCKS]
                self.mgr.free_floor = max(0, free - (quota - held))
        q, h, qt, ht = pool.stats
        return free, q, h, qt, ht

    def end(self, base: int, start: tuple) -> None:
        """After the frame: what it changed (since `begin` gave `start`)
        goes to the tenant."""
        pool = self._pool
        free, q, h, qt, ht = start
        w = self._words
        now = pool.num_free_blocks
        if now != free:
            w[base + _BLOCKS] += free - now
        st = pool.stats
        if st[0] != q:
            w[base + _QUERIES] += st[0] - q
            w[base + _HITS] += st[1] - h
            w[base + _QUERY_TOKENS] += st[2] - qt
            w[base + _HIT_TOKENS] += st[3] - ht
        if self.quotas:
            self.mgr.free_floor = 0

    def refused(self, slot: int) -> None:
        """An allocation of this tenant failed for its quota, not the pool
        (`KVCacheManager.refused_by_floor`)."""
        self.metrics.tenant_add(slot, "quota_refusals", 1)
        self.metrics.add("quota_refusals")

    # -- restarts -----------------------------------------------------------------------
    def rebuild(self, held: dict[bytes, list[str]]) -> None:
        """After an adoption: every tenant's blocks, counted from the
        request table (`held`: tenant digest -> request ids)."""
        words = self.metrics.words
        for slot in range(TENANT_SLOTS):
            if words[tenant_word(slot, "used")]:
                self._remember(tenant_name(words, slot).decode(), slot)
        managers = self.mgr.groups.managers
        for slot in self._slots.values():
            self.metrics.tenant_set(slot, "blocks", 0)
        for digest, rids in held.items():
            found = self._by_digest.get(digest)
            if found is None:
                continue
            slot = found[1]
            blocks = {b for m in managers for rid in rids for b in m.req_to_blocks.get(rid, ())
                      if b}
            self.metrics.tenant_set(slot, "blocks", len(blocks))
        for name, slot in self._slots.items():
            self.metrics.tenant_set(slot, "quota", self.quotas.get(name, -1))


def unscoped(scope: str, text: str) -> str:
    """`text` (an error message or field) with `scope`'s request-id prefix
    removed, as is or as repr() writes it."""
    if not scope:
        return text
    return text.replace(scope, "").replace(scope.replace(SCOPE_MARK, "\\x1f"), "")


def check_request_id(rid: str) -> None:
    if SCOPE_MARK in rid:
        raise InvalidArgument("request ids may not contain U+001F")
