"""What a client needs to ride through a coordinator restart.

`Reconnect` is the backoff policy.  `RequestMirror` is the client's copy of
the request state the coordinator keeps only in memory (each live request's
tokens or hashes, its extra keys, computed count and the prefix-cache
lookup it is still to use), updated from every reply, so that after a
restart the client can restore its requests (`restore_frames`): the
coordinator takes back their block tables from the segment, AddRequest +
Advance give them their tokens again, and RestoreHits their lookup (kept
when the pool finds the same blocks again).

How the calls in flight at a restart are settled, and what a session that
could not be given back does, is client_core.py's, the same for both
clients: frames are numbered per session, and the coordinator records the
seq of each frame inside that frame's journaled mutation, with its reply;
on resume it says `last_seq`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshm.ops import protocol as p

RESTORE_REQUESTS_PER_FRAME = 64


@dataclass(frozen=True)
class Reconnect:
    """Reconnection after the coordinator went away: retry every
    `initial_delay` seconds, doubling up to `max_delay`, for at most
    `timeout` seconds in all (each attempt waits `connect_timeout`)."""

    initial_delay: float = 0.02
    max_delay: float = 1.0
    timeout: float = 60.0
    connect_timeout: float = 5.0


class MirroredRequest:
    """One live request as the coordinator holds it: its tokens (or block
    hashes and token count), the AddRequest that made it, its computed count
    and the hits of its last lookup while an allocation may still use them."""

    __slots__ = ("tokens", "hashes", "num_tokens", "num_prompt", "op", "computed", "hits")

    def __init__(self, op: p.AddRequest) -> None:
        self.op = op      # its lora name, salt, items and embeds, as sent
        tokens = op.prompt
        if tokens is None and op.block_hashes is None:   # prompt embeds: ids are zeros
            tokens = [0] * op.num_tokens
        self.tokens = None if tokens is None else list(tokens)
        self.hashes = None if op.block_hashes is None else list(op.block_hashes)
        self.num_tokens = len(self.tokens) if self.tokens is not None else op.num_tokens
        # Where the prompt ended: a restore hashes the prompt and the tokens
        # appended after it in separate passes, as they were (extra_keys.py).
        self.num_prompt = op.num_prompt_tokens or self.num_tokens
        self.computed = 0
        self.hits: list[list[int]] | None = None


class RequestMirror:
    """The client-side state of its live requests, kept from the replies."""

    def __init__(self) -> None:
        self._reqs: dict[str, MirroredRequest] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, rid: str) -> bool:
        return rid in self._reqs

    def get(self, rid: str) -> MirroredRequest | None:
        """Request `rid` as the coordinator holds it (None if it does not)."""
        return self._reqs.get(rid)

    def clear(self) -> None:
        self._reqs.clear()

    def apply(self, msg, reply) -> None:
        """Record the effect of `msg`, answered by `reply`."""
        if reply.__class__ is p.Error:   # refused whole: nothing happened
            return
        if msg.__class__ is p.Batch:
            one = self._one
            for op, r in zip(msg.ops, reply.results):
                if r.__class__ is p.Error:
                    break
                one(op, r)
        else:
            self._one(msg, reply)

    def _one(self, op, reply) -> None:
        cls = op.__class__
        if cls is p.Advance:
            r = self._reqs.get(op.req)
            if r is None:
                return
            if op.append_hashes or op.num_appended:
                r.hashes.extend(op.append_hashes)
                r.num_tokens += op.num_appended
            elif op.append:
                r.tokens.extend(op.append)
                r.num_tokens += len(op.append)
            r.computed = op.num_computed_tokens
        elif cls is p.AddRequest:
            self._reqs[op.req] = MirroredRequest(op)
        elif cls is p.GetComputedBlocks:
            r = self._reqs.get(op.req)
            if r is not None:
                r.hits = reply.block_ids if any(reply.block_ids) else None
        elif cls is p.AllocateSlots:
            if op.use_computed_blocks and reply.new_block_ids is not None:
                r = self._reqs.get(op.req)
                if r is not None:
                    r.hits = None      # used
        elif cls is p.Free:
            if op.preempted:
                r = self._reqs.get(op.req)
                if r is not None:
                    r.hits = None
            else:
                self._reqs.pop(op.req, None)

    def forget(self, msg) -> None:
        """The effect of `msg` is unknown (its reply was lost): drop the
        requests it names, which the restore then releases."""
        for op in (msg.ops if msg.__class__ is p.Batch else (msg,)):
            rid = getattr(op, "req", None)
            if rid is not None:
                self._reqs.pop(rid, None)

    def restore_frames(self, held: list[str]) -> list[p.Batch]:
        """Frames that give the coordinator every request back (AddRequest
        with all its tokens, Advance to its computed count, RestoreHits for
        a lookup it is still to use) and free the taken-back ones this
        client does not know any more."""
        frames, ops, n = [], [], 0
        for rid, r in self._reqs.items():
            o = r.op
            ops.append(p.AddRequest(
                rid, r.tokens, r.hashes, 0 if r.tokens is not None else r.num_tokens,
                o.lora_name, o.cache_salt, o.skip_reading_prefix_cache, o.mm_features,
                o.prompt_embeds, r.num_prompt if r.tokens is not None else 0, o.lora_path))
            ops.append(p.Advance(rid, r.computed))
            if r.hits is not None:
                ops.append(p.RestoreHits(rid, r.hits))
            n += 1
            if n == RESTORE_REQUESTS_PER_FRAME:
                frames.append(p.Batch(ops))
                ops, n = [], 0
        gone = [p.Free(rid) for rid in held if rid not in self._reqs]
        for i in range(0, len(gone), 2 * RESTORE_REQUESTS_PER_FRAME):
            ops += gone[i:i + 2 * RESTORE_REQUESTS_PER_FRAME]
            frames.append(p.Batch(ops))
            ops = []
        if ops:
            frames.append(p.Batch(ops))
        return frames
