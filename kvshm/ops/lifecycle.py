"""Sessions' lifecycle on the op executor, sans-IO: a session opening (an
`Owner`, with a record in the segment when sessions are resumable) and
ending (its requests freed in one frame), and a coordinator restart: the
previous coordinator's sessions adopted from their records (`adopt`), taken
back by their resume token (`resume`), and those that did not come back
freed once the grace period is over (`expire_unresumed`).

`OpExecutor` (executor.py) runs the ops; this runs the sessions around them
and reaches the executor only through its public state (its manager, owners,
requests, tenants, metrics, session table and hashers).
"""

from __future__ import annotations

import secrets

from kvshm.core.metrics import tenant_base
from kvshm.ops.errors import ResumeFailed
from kvshm.ops.owner import Owner, ReqState
from kvshm.ops.sessions import SessionRecord, tenant_digest


class SessionLifecycle:
    """Opens, ends and, after a restart, adopts and resumes the sessions of
    executor `ex` (an `OpExecutor`)."""

    def __init__(self, ex) -> None:
        self.ex = ex
        # Sessions of the previous coordinator that may still resume, by id:
        # their record and the ids of the requests they hold.
        self.unresumed: dict[int, tuple[SessionRecord, list[str]]] = {}

    # -- sessions --------------------------------------------------------------------------
    def open(self, id: int, tenant: str = "", *, admin: bool = False, pid: int = 0,
             node: int = -1) -> Owner:
        """Register owner `id` (a session) of `tenant`'s namespace; with
        resumable sessions it gets a record and a secret `resume_token`."""
        owner = Owner(id, tenant, self.ex.hasher_for(tenant), admin, self.ex.tenants.slot(tenant))
        if self.ex.sessions is not None:
            token = secrets.token_urlsafe(24)
            owner.record = self.ex.sessions.allocate(id, token, tenant, admin=admin, pid=pid,
                                                     node=node)
            if owner.record is not None:
                owner.resume_token = token
        self.ex.owners[id] = owner
        self.ex.metrics.add("sessions_total")
        self.ex.metrics.set("sessions_open", len(self.ex.owners))
        return owner

    def close(self, owner: Owner) -> None:
        """Free every request of `owner` and forget it (a session ended),
        in one frame."""
        if self.ex.owners.pop(owner.id, None) is None:
            return
        mgr = self.ex.mgr
        if mgr.segment.closed:
            return
        self.ex.metrics.set("sessions_open", len(self.ex.owners))
        # The record goes first, outside the frame: a rollback cannot bring
        # the client back, so a restart that this frame's crash cut short
        # frees the requests as those of a session without a record, at once.
        if owner.record is not None:
            self.ex.sessions.release(owner.record)
            owner.record = None
        mgr.begin_frame()
        start = self.ex.tenants.begin(owner.tenant, owner.mbase)
        for rid in owner.requests:
            self.ex.requests.pop(rid, None)
            mgr.free(rid)
        self.ex.tenants.end(owner.mbase, start)
        owner.requests.clear()
        mgr.commit_frame()

    # -- restarts ------------------------------------------------------------------------
    def adopt(self) -> dict[str, int]:
        """After a restart: the sessions that may resume, each holding its
        requests as placeholders; requests of sessions without a record are
        freed.  Returns counts for the log."""
        mgr = self.ex.mgr
        records = {r.session_id: r for r in self.ex.sessions.records()}
        for r in records.values():
            self.ex.sessions.take(r.slot)
        held: dict[int, list[str]] = {}
        table = mgr.table
        for rid, slot in table.slot_of.items():
            held.setdefault(table.owner(slot), []).append(rid)
        orphaned = 0
        mgr.begin_frame()
        for sid, rids in held.items():
            if sid not in records:
                for rid in rids:
                    mgr.free(rid)
                orphaned += len(rids)
        mgr.commit_frame()
        self.unresumed = {sid: (rec, held.get(sid, [])) for sid, rec in records.items()}
        by_tenant: dict[bytes, list[str]] = {}
        for rec, rids in self.unresumed.values():
            by_tenant.setdefault(rec.tenant, []).extend(rids)
        self.ex.tenants.rebuild(by_tenant)
        return {"sessions": len(records),
                "requests": sum(len(rids) for _, rids in self.unresumed.values()),
                "freed_without_session": orphaned}

    def max_session_id(self) -> int:
        """The largest session id the segment knows (new ids go above it)."""
        ids = list(self.unresumed)
        table = self.ex.mgr.table
        ids += [table.owner(slot) for slot in table.slot_of.values()]
        return max(ids, default=0)

    def resume(self, token: str, tenant: str, *, admin: bool) -> tuple[Owner, list[str]]:
        """Take back the session whose resume token is `token`: its owner
        (same id, seq and token) and the ids of its requests (placeholders
        until restored).  Raises ResumeFailed (unknown, expired or live
        session, other tenant); nothing changes then."""
        sessions = self.ex.sessions
        if sessions is None:
            raise ResumeFailed("this pool does not keep resumable sessions")
        for sid, (rec, rids) in self.unresumed.items():
            if sessions.token_matches(rec, token):
                break
        else:
            live = any(o.resume_token and o.resume_token == token
                       for o in self.ex.owners.values())
            raise ResumeFailed("that session is connected already (a resume token is "
                               "good for one connection)" if live else
                               "no session to resume with that token (wrong token, "
                               "another pool's, or the grace period is over)")
        if rec.tenant != tenant_digest(tenant):
            raise ResumeFailed("the resume token belongs to another tenant's session")
        del self.unresumed[sid]
        owner = Owner(sid, tenant, self.ex.hasher_for(tenant), admin, self.ex.tenants.slot(tenant))
        owner.record = rec.slot
        owner.seq = rec.last_seq
        owner.resume_token = token
        for rid in rids:
            self.ex.requests[rid] = ReqState(None, owner)
            owner.requests.add(rid)
        self.ex.owners[sid] = owner
        self.ex.metrics.add("sessions_resumed")
        self.ex.metrics.set("sessions_open", len(self.ex.owners))
        n = len(owner.scope)
        return owner, [rid[n:] for rid in rids]

    def expire_unresumed(self) -> int:
        """The grace period is over: free the requests of sessions that did
        not come back (their cached blocks stay cached), drop their records.
        Returns how many requests were freed."""
        mgr = self.ex.mgr
        freed = 0
        book = self.ex.tenants
        mgr.begin_frame()
        for rec, rids in self.unresumed.values():
            tenant = book.by_digest(rec.tenant)
            base = None if tenant is None else tenant_base(tenant[1])
            start = None if tenant is None else book.begin(tenant[0], base)
            for rid in rids:
                mgr.free(rid)
            if start is not None:
                book.end(base, start)
            freed += len(rids)
            self.ex.sessions.release(rec.slot)
        mgr.commit_frame()
        self.unresumed = {}
        return freed
