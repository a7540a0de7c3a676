"""Whom an op runs for (`Owner`: a session of a tenant) and what the
executor keeps of each request (`ReqState`)."""

from __future__ import annotations

from kvshm.core.metrics import tenant_base
from kvshm.core.request import Request
from kvshm.ops.tenants import TenantBook

MAX_OWNER_EVENTS = 100_000   # KV-cache events kept for a session between its TakeEvents


class Owner:
    """Whom an op runs for: a session id (the request table's owner word),
    the block hasher of its tenant's namespace, and whether it may run the
    pool-wide destructive ops (reset, evict) and see block ids it does not
    hold (the free queue)."""

    __slots__ = ("id", "tenant", "hasher", "admin", "requests", "record", "seq",
                 "resume_token", "events", "events_dropped", "slot", "mbase", "scope")

    def __init__(self, id: int, tenant: str, hasher, admin: bool = False,
                 slot: int = 0) -> None:
        self.id = id
        self.tenant = tenant
        self.hasher = hasher
        self.admin = admin
        self.slot = slot                              # its tenant's (tenants.py)
        self.mbase = tenant_base(slot)                # that slot's metrics words
        self.scope = TenantBook.scope(tenant, slot)   # its request ids' prefix
        self.requests: set[str] = set()
        self.record: int | None = None   # its session record's slot (resumable)
        self.seq = 0                     # frames applied for it
        self.resume_token = ""
        self.events: list | None = None  # its frames' KV-cache events (once it took some)
        self.events_dropped = 0

    def add_events(self, events: list) -> None:
        """Keep events for its next TakeEvents, at most MAX_OWNER_EVENTS (the
        oldest go first, counted)."""
        kept = self.events
        kept.extend(events)
        over = len(kept) - MAX_OWNER_EVENTS
        if over > 0:
            del kept[:over]
            self.events_dropped += over


class ReqState:
    """A request the executor knows: its `Request` (None: a placeholder for
    a request adopted after a restart, until its owner restores it), owner
    and last hits."""

    __slots__ = ("request", "owner", "hits", "claimed")

    def __init__(self, request: Request | None, owner: Owner) -> None:
        self.request = request
        self.owner = owner
        self.hits = None
        self.claimed = False   # its table slot records its owner
