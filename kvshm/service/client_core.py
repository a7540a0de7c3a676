"""What the asyncio client (client.py) and the synchronous one
(sync_client.py) share, written once: the protocol's operations
(`Operations`), the session state both keep (`ClientSession`, their base),
the reconnect schedule (`Backoff`) and the frames in flight with how they
are settled after a coordinator restart (`InFlight`).

Nothing here waits or does I/O: the clients differ only in how they send a
frame and wait for its reply.  `Operations` builds each op's message and
reads the answer out of its reply; a client runs the message through its
`_op(msg, timeout, answer)`, which returns the answer (the synchronous
client) or an awaitable of it (the asyncio client).

How a restart is ridden through, the same in both clients:
1. The connection breaks: the client reconnects on the `Backoff` schedule
   (bounded exponential, `Reconnect` in resume.py) and presents its resume
   token.
2. The coordinator gave the session back: `InFlight.resumed` settles the
   frames it had applied (numbered up to the Welcome's `last_seq`; each gets
   its reply, which the coordinator keeps for the session's last frames, as
   far as they fit: ReplyLost only for one it no longer kept), the client
   restores its requests (`RequestMirror.restore_frames`, with the lookups
   they are still to use) and sends the frames not applied again, in order.
   No call is lost silently or applied twice.
3. The coordinator could not give the session back: `InFlight.fresh_session`
   fails every call in flight with ResumeFailed and forgets the requests;
   the client goes on as a fresh session, so later calls work (add the
   requests again).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import msgspec

from kvshm.core.errors import KvshmError
from kvshm.core.events import decode_events
from kvshm.ops import protocol as p
from kvshm.ops.errors import (ConnectionLost, ReplyLost, RequestTimeout, ResumeFailed,
    batch_results, error_from_wire, raise_reply)
from kvshm.ops.protocol import encode_frame
from kvshm.service.handshake import SessionInfo
from kvshm.service.resume import Reconnect, RequestMirror

# What a failed connection attempt raises while the client reconnects.
CONNECT_ERRORS = (ConnectionLost, RequestTimeout, OSError)


class Call:
    """A frame sent (or to be sent again after a restart) awaiting its reply.
    `waiter` is the asyncio client's future; the synchronous client reads
    `reply` / `error` once `settled`."""

    __slots__ = ("msg", "frame", "seq", "waiter", "settled", "reply", "error")

    def __init__(self, msg, waiter=None) -> None:
        self.msg = msg
        self.frame = encode_frame(msg)
        self.seq = 0
        self.waiter = waiter
        self.settled = False
        self.reply = None
        self.error: KvshmError | None = None


class InFlight:
    """A session's frames in flight, oldest first, numbered as they are sent,
    and the client's `RequestMirror`, kept from their replies."""

    def __init__(self, mirror: RequestMirror) -> None:
        self.mirror = mirror
        self.calls: deque[Call] = deque()
        self.seq = 0                    # frames sent in this session
        self.replies_lost = 0           # applied calls whose replies a restart lost
        self.resumed_requests = 0       # requests restored after restarts

    def __len__(self) -> int:
        return len(self.calls)

    def add(self, call: Call, *, first: bool = False) -> None:
        """`call` awaits its reply: after the others, or (a restore frame,
        sent ahead of them) before them."""
        if first:
            self.calls.appendleft(call)
        else:
            self.calls.append(call)

    def number(self, call: Call) -> bytes:
        """`call` goes out now: its seq, and the bytes to write."""
        self.seq += 1
        call.seq = self.seq
        return call.frame

    def first_sent(self) -> int:
        """The seq of the oldest call sent and not answered (0: none), from
        which a resume asks for the kept replies."""
        for call in self.calls:
            if call.seq:
                return call.seq
        return 0

    def to_resend(self) -> list[Call]:
        """The calls a resume found not applied, to go out again in order."""
        return list(self.calls)

    def answered(self, reply) -> Call:
        """The next reply arrived: the oldest call's, recorded in the mirror."""
        call = self.calls.popleft()
        self.mirror.apply(call.msg, reply)
        call.settled, call.reply = True, reply
        return call

    def fail_all(self, err: KvshmError) -> list[Call]:
        """Every call in flight fails with `err`; the calls, to deliver."""
        calls = list(self.calls)
        self.calls.clear()
        for call in calls:
            call.settled, call.error = True, err
        return calls

    def resumed(self, welcome: p.Welcome, decode: Callable[[bytes], object]) -> list[Call]:
        """The session was given back: settle the calls it applied (up to
        `last_seq`), number on from there; the settled calls, to deliver.
        The rest stay in flight, to be sent again after the restore."""
        last = welcome.last_seq
        first, kept = welcome.replies_from, welcome.replies
        settled = []
        calls = self.calls
        while calls and 0 < calls[0].seq <= last:
            call = calls.popleft()
            call.settled = True
            body = kept[call.seq - first] if 0 <= call.seq - first < len(kept) else b""
            if body:
                call.reply = decode(body)
                self.mirror.apply(call.msg, call.reply)
            else:
                self.replies_lost += 1
                self.mirror.forget(call.msg)
                call.error = ReplyLost("the coordinator restarted after applying this call, "
                                       "before its reply was delivered; read the state back")
            settled.append(call)
        self.seq = last
        self.resumed_requests += len(self.mirror)
        return settled

    def fresh_session(self, welcome: p.Welcome) -> list[Call]:
        """The coordinator could not give the session back: its requests are
        gone and every call in flight fails with ResumeFailed; the calls, to
        deliver.  The client goes on as the fresh session."""
        self.mirror.clear()
        self.seq = 0
        return self.fail_all(ResumeFailed(
            "the coordinator restarted and this session could not be resumed: "
            + (welcome.resume_error or "it keeps no session records")))


class Backoff:
    """One reconnection's schedule: `next_delay` after each failed attempt,
    until the policy's timeout (counted from the loss) is over."""

    def __init__(self, policy: Reconnect, lost: Exception) -> None:
        self.policy = policy
        self.lost = lost
        self.deadline = time.monotonic() + policy.timeout
        self.delay = policy.initial_delay

    def next_delay(self, err: Exception) -> float:
        """Seconds to wait before the next attempt after `err`; raises
        ConnectionLost when that would pass the deadline."""
        delay = self.delay
        if time.monotonic() + delay > self.deadline:
            raise ConnectionLost(f"the coordinator went away ({self.lost}) and did not come "
                                 f"back within {self.policy.timeout:g}s: {err}") from None
        self.delay = min(delay * 2, self.policy.max_delay)
        return delay


def resume_hello(hello: p.Hello, token: str, flight: InFlight) -> p.Hello:
    """The Hello that takes a session back, with the replies of its calls in
    flight."""
    return msgspec.structs.replace(hello, resume_token=token, resume_from=flight.first_sent())


def shutdown_error(msg: p.Shutdown) -> ConnectionLost:
    return ConnectionLost(f"the coordinator shut down ({msg.reason})")


def check_restored(reply) -> None:
    """Raise the error of a restore frame's reply, if it has one."""
    for r in (reply.results if reply.__class__ is p.BatchReply else (reply,)):
        if r.__class__ is p.Error:
            raise error_from_wire(r.code, "restoring requests after a coordinator "
                                  f"restart: {r.message}", r.fields)


# -- the operations ---------------------------------------------------------------------
def checked(reply):
    """`reply`, or the exception of an `Error` reply raised."""
    if reply.__class__ is p.Error:
        raise_reply(reply)
    return reply


def _nothing(reply) -> None:
    return None


def _hits(reply) -> tuple[list[list[int]], int]:
    return reply.block_ids, reply.num_computed_tokens


def _itself(reply):
    return reply


def _new_block_ids(reply):
    return reply.new_block_ids


def _num_free_blocks(reply) -> int:
    return reply.num_free_blocks


def _block_ids(reply) -> list[list[int]]:
    return reply.block_ids


def _num_blocks(reply) -> list[int]:
    return reply.num_blocks


def _ok(reply) -> bool:
    return reply.ok


def _events(reply) -> list:
    return decode_events(reply.payload)


def _uncached(reply) -> list[int]:
    return reply.block_ids


def _num_tokens(reply) -> int:
    return reply.num_tokens


class Operations:
    """One method per operation of the protocol, the same in both clients
    (awaitable on `Client`, blocking on `SyncClient`).  Each raises the
    error of an `Error` reply (kvshm.ops.errors)."""

    __slots__ = ()

    def _op(self, msg, timeout: float | None, answer: Callable):
        """`answer(reply)` of `msg`'s reply, an Error reply raised (each
        client says how it waits: `checked` and `answer` on its reply)."""
        raise NotImplementedError

    def call(self, msg: msgspec.Struct, timeout: float | None = None):
        """Send one message, return its reply struct (Error replies raise)."""
        return self._op(msg, timeout, _itself)

    def batch(self, ops: Sequence[msgspec.Struct], timeout: float | None = None) -> list:
        """Run `ops` in one frame, atomically with respect to other sessions.
        Returns their replies; if one failed, raises its error with
        `.results` (the replies before it) and `.index` set."""
        return self._op(p.Batch(list(ops)), timeout, batch_results)

    def add_request(self, req: str, prompt: Sequence[int] | None = None, *,
                    block_hashes: list[bytes] | None = None, num_tokens: int = 0,
                    lora_name: str | None = None, cache_salt: str | None = None,
                    skip_reading_prefix_cache: bool = False, mm_features=None,
                    prompt_embeds=None, lora_path: str | None = None,
                    timeout: float | None = None) -> None:
        """Add a request: its prompt's token ids (with its multimodal items
        and prompt embeds, if any), or the hashes of its full blocks and its
        token count (see `protocol.add_request`).  `lora_path`: the LoRA
        adapter's path, which a pool of vLLM 0.32's semantics hashes."""
        return self._op(p.add_request(req, prompt, block_hashes, num_tokens, lora_name,
                                      cache_salt, skip_reading_prefix_cache, mm_features,
                                      prompt_embeds, lora_path), timeout, _nothing)

    def advance(self, req: str, num_computed_tokens: int, append: Sequence[int] = (), *,
                append_hashes: list[bytes] = (), num_appended: int = 0,
                timeout: float | None = None) -> None:
        """The request computed up to `num_computed_tokens` and grew by
        `append` (or by `num_appended` tokens whose full blocks hash to
        `append_hashes`)."""
        return self._op(p.Advance(req, num_computed_tokens, list(append), list(append_hashes),
                                  num_appended), timeout, _nothing)

    def get_computed_blocks(self, req: str, timeout: float | None = None
                            ) -> tuple[list[list[int]], int]:
        """The request's prefix-cache hits: block ids per group, and the
        tokens they hold (`call(GetComputedBlocks(req))` gives the whole
        reply, with a 0.32 pool's `shared_prefix_boundary`)."""
        return self._op(p.GetComputedBlocks(req), timeout, _hits)

    def allocate_slots(self, req: str, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       *, use_computed_blocks: bool = False, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       waiting: bool = False, has_scheduled_reqs: bool = True,
                       reserved_blocks: int = 0,
                       timeout: float | None = None) -> list[list[int]] | None:
        """New block ids per group, or None if the pool is short of blocks.
        `use_computed_blocks` passes this request's last lookup's hits.  On a
        pool of vLLM 0.32's semantics, an admission from the waiting queue
        says `waiting` (and with `full_sequence_must_fit` is refused unless
        all its tokens fit; `has_scheduled_reqs`: others run, so the pool's
        watermark applies); other pools ignore the three.  `reserved_blocks`
        must stay free after the allocation (any pool)."""
        return self._op(p.AllocateSlots(
            req, num_new_tokens, num_new_computed_tokens, use_computed_blocks,
            num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
            num_encoder_tokens, full_sequence_must_fit, waiting, has_scheduled_reqs,
            reserved_blocks),
            timeout, _new_block_ids)

    def admit(self, req: str, max_new_tokens: int, *, num_lookahead_tokens: int = 0,
              delay_cache_blocks: bool = False, wait_in_flight: int = 0,
              timeout: float | None = None) -> p.Admitted:
        """Lookup + allocation of a waiting request in one atomic step (see
        `protocol.Admit`); `.new_block_ids` is None if the pool is short, or
        if at least `wait_in_flight` (> 0) tokens past the hit are in
        flight (`.num_in_flight_tokens`)."""
        return self._op(p.Admit(req, max_new_tokens, num_lookahead_tokens, delay_cache_blocks,
                                wait_in_flight), timeout, _itself)

    def cache_blocks(self, req: str, num_computed_tokens: int,
                     timeout: float | None = None) -> None:
        """Cache the request's full blocks up to `num_computed_tokens`."""
        return self._op(p.CacheBlocks(req, num_computed_tokens), timeout, _nothing)

    def free(self, req: str, *, preempted: bool = False, timeout: float | None = None) -> int:
        """Free the request's blocks; it is forgotten unless `preempted`.
        Returns the pool's free-block count."""
        return self._op(p.Free(req, preempted), timeout, _num_free_blocks)

    def remove_skipped_blocks(self, req: str, total_computed_tokens: int,
                              timeout: float | None = None) -> int:
        """Free the blocks a window or chunk no longer reaches; the pool's
        free-block count."""
        return self._op(p.RemoveSkippedBlocks(req, total_computed_tokens), timeout,
                        _num_free_blocks)

    def get_block_ids(self, req: str, timeout: float | None = None) -> list[list[int]]:
        return self._op(p.GetBlockIds(req), timeout, _block_ids)

    def get_num_common_prefix_blocks(self, req: str, timeout: float | None = None) -> list[int]:
        return self._op(p.NumCommonPrefixBlocks(req), timeout, _num_blocks)

    def new_step_starts(self, timeout: float | None = None) -> None:
        """A scheduler step begins (vLLM 0.32's hook)."""
        return self._op(p.NewStepStarts(), timeout, _nothing)

    def estimate_cached_tokens(self, req: str, timeout: float | None = None) -> int:
        """Tokens the request's cached blocks cover (vLLM 0.32 asks it at a
        request's first output)."""
        return self._op(p.EstimateCachedTokens(req), timeout, _num_tokens)

    def reset_prefix_cache(self, timeout: float | None = None) -> bool:
        """Uncache every block (admin sessions only)."""
        return self._op(p.ResetPrefixCache(), timeout, _ok)

    def evict_blocks(self, block_ids: Sequence[int], timeout: float | None = None) -> int:
        """Uncache these blocks (admin sessions only); the free-block count."""
        return self._op(p.EvictBlocks(list(block_ids)), timeout, _num_free_blocks)

    def report_corrupt(self, req: str, block_ids: Sequence[int],
                       timeout: float | None = None) -> list[int]:
        """Blocks of request `req` (ones it holds and read) whose K/V are
        wrong: they leave the prefix cache with every block computed from
        them, so nobody hits them again.  Returns the ids uncached (free the
        request and admit it again to recompute them)."""
        return self._op(p.ReportCorrupt(req, list(block_ids)), timeout, _uncached)

    def stats(self, free_head: int = 0, timeout: float | None = None) -> p.Stats:
        return self._op(p.GetStats(free_head), timeout, _itself)

    def take_events(self, timeout: float | None = None) -> list:
        """The KV-cache events this session's frames caused since its last
        call (kvshm.core.events structs; the first call starts recording)."""
        return self._op(p.TakeEvents(), timeout, _events)


class ClientSession(SessionInfo, Operations):
    """What both clients keep of their session: where and how it was opened
    (to open it again after a restart), the requests the coordinator holds
    for it (`requests`, a `RequestMirror`), its calls in flight and the
    restarts it rode through."""

    def __init__(self, path, hello: p.Hello, welcome: p.Welcome,
                 reconnect: Reconnect | None) -> None:
        self.path = path
        self._hello = hello
        self.reconnect = reconnect
        self.tenant = hello.tenant
        self.requests = RequestMirror()
        self._flight = InFlight(self.requests)
        self.restarts: list[tuple[float, float]] = []   # (lost at, resumed at), monotonic
        self.take_welcome(welcome)

    @property
    def calls_in_flight(self) -> int:
        """Calls sent, or waiting to be sent again, whose replies are unread
        (a cancelled or timed-out call's reply is read when it comes)."""
        return len(self._flight)

    @property
    def replies_lost(self) -> int:
        """Applied calls whose replies a restart lost (each raised ReplyLost)."""
        return self._flight.replies_lost

    @property
    def resumed_requests(self) -> int:
        """Requests restored after restarts."""
        return self._flight.resumed_requests
