"""Follow-up turns wait for the answer they continue.

In a chat, turn k+1 of a conversation is sent after turn k's answer came
back: its prompt holds that answer.  A workload split among workers
(`assign`, below) may put the two turns on different workers, so the wait
crosses processes: a `TurnBoard` is a small shared-memory table, one per
run, created by the launcher, where a worker marks a turn done once its
request is over (its blocks cached and freed, or it was aborted or
rejected), and a worker holds a later turn back ("not yet arrived") until
the turn before it is done.  Without it every turn would be runnable at
once, and a follow-up could run before the history it repeats had been
computed anywhere, which no prefix cache could serve.

A conversation is identified by `Item.key` (its number in order of first
appearance, set by `assign`) and a turn by `Item.turn`; `Item.after` is the
worker that serves the previous turn.  A worker that died never marks its
turns: the launcher marks the worker dead (`mark_dead`) and turns after it
go ahead.  Slots are a ring of `SLOTS` conversations, each holding (key,
turns done) in one 8-byte word (aligned stores: readers never see half of
one); a conversation more than `SLOTS` behind the newest is long over.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import numpy as np

from kvshm.pool.shm import Shm, create_shm, open_shm
from kvshm.workload.items import Item, stable_hash

SLOTS = 1 << 16
MAX_WORKERS = 4096
_TURN_BITS = 16           # turns done per conversation, below the key
_TURN_MASK = (1 << _TURN_BITS) - 1


class TurnBoard:
    """The run's table of finished turns (see the module docstring).
    `TurnBoard.create()` in the launcher (which unlinks it), `attach(name)`
    in each worker."""

    def __init__(self, shm: Shm, owner: bool) -> None:
        self._shm = shm
        self.owner = owner
        self.name = shm.name
        self._slots = np.frombuffer(shm.mmap, dtype=np.uint64, count=SLOTS)
        self._dead = np.frombuffer(shm.mmap, dtype=np.uint8, count=MAX_WORKERS,
                                   offset=SLOTS * 8)

    @classmethod
    def create(cls, name: str | None = None) -> "TurnBoard":
        """A new, empty board named `name` (None: a fresh `kvshm-<random>`)."""
        return cls(create_shm(name, SLOTS * 8 + MAX_WORKERS, what="turn board"), owner=True)

    @classmethod
    def attach(cls, name: str) -> "TurnBoard":
        """The board the launcher created; SegmentError if there is none."""
        return cls(open_shm(name, "turn board"), owner=False)

    def done(self, key: int, turn: int) -> None:
        """Turn `turn` of conversation `key` is over: the next one may run."""
        slot = key % SLOTS
        word = (key << _TURN_BITS) | min(turn + 1, _TURN_MASK)
        if int(self._slots[slot]) >> _TURN_BITS <= key:    # an older conversation's slot
            self._slots[slot] = word

    def ready(self, key: int, turn: int, after: int) -> bool:
        """Whether turn `turn` of conversation `key`, whose previous turn
        worker `after` serves (-1: none, a first turn), may run now."""
        if turn == 0 or after < 0 or self._dead[after % MAX_WORKERS]:
            return True
        word = int(self._slots[key % SLOTS])
        owner = word >> _TURN_BITS
        if owner != key:
            return owner > key      # overwritten by a newer conversation: long over
        return (word & _TURN_MASK) >= turn

    def mark_dead(self, worker: int) -> None:
        """Worker `worker` died: its turns will never be marked done."""
        self._dead[worker % MAX_WORKERS] = 1

    def unlink(self) -> None:
        """Remove the name (the creator, once every worker has attached:
        then a launcher killed outright leaves nothing); mappings stay."""
        if self.owner:
            self._shm.unlink()

    def close(self) -> None:
        """Unmap (and, in the creator, remove) the board."""
        del self._slots, self._dead
        self._shm.close()
        self.unlink()

    def __enter__(self) -> "TurnBoard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LocalTurns:
    """The board of a worker that was given none (`python -m kvshm.workers`
    on its own): turns it serves itself wait for each other; a turn after
    another worker's may run at once, as nothing would tell when that one
    is done.  `worker` None: no turn waits."""

    def __init__(self, worker: int | None) -> None:
        self.worker = worker
        self._done: dict[int, int] = {}

    def done(self, key: int, turn: int) -> None:
        self._done[key] = max(self._done.get(key, 0), turn + 1)

    def ready(self, key: int, turn: int, after: int) -> bool:
        if turn == 0 or after != self.worker:
            return True
        return self._done.get(key, 0) >= turn

    def mark_dead(self, worker: int) -> None:
        """Nothing to do: turns after other workers never wait here."""

    def close(self) -> None:
        self._done.clear()


ASSIGN_MODES = ("round-robin", "hash")


def assign(items: Iterable[Item], worker: int, num_workers: int,
           how: str = "round-robin") -> Iterator[Item]:
    """The share of a stream that one worker takes.

    Args:
        items: the stream (may be infinite; consumed lazily).
        worker: this worker's index, 0 <= worker < num_workers.
        num_workers: how many workers split the stream, >= 1.
        how: "round-robin" (items worker, worker + num_workers, ...) or
            "hash" (a stable hash of the conversation id mod num_workers, so
            a conversation stays on one worker).
    Returns:
        An iterator over this worker's items, in stream order, each with
        `key` and `after` set (the conversation's number, the worker of its
        previous turn: see workers/turns.py).  Over all workers the shares
        partition the stream.
    Raises:
        ValueError: an unknown `how`, num_workers < 1 or worker out of range
            (raised by this call, not on first next()).
    """
    if how not in ASSIGN_MODES:
        raise ValueError(f"how must be one of {ASSIGN_MODES}, got {how!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < num_workers:
        raise ValueError(f"worker must be in [0, {num_workers}), got {worker!r}")
    return _assign(items, worker, num_workers, how == "round-robin")


def _assign(items: Iterable[Item], worker: int, num_workers: int,
            round_robin: bool) -> Iterator[Item]:
    # Conversations unseen for the last SLOTS conversations are
    # forgotten (a bounded table over an endless stream): a later turn of
    # one starts a new key and waits for nothing.
    latest: OrderedDict[str, tuple[int, int, int]] = OrderedDict()  # -> key, turn, worker
    next_key = 0
    for i, it in enumerate(items):
        w = i % num_workers if round_robin else stable_hash(it.conversation) % num_workers
        seen = latest.pop(it.conversation, None)
        if seen is None:
            key, after = next_key, -1
            next_key += 1
            if len(latest) >= SLOTS:
                latest.popitem(last=False)
        else:
            key, after = seen[0], (seen[2] if seen[1] == it.turn - 1 else -1)
        latest[it.conversation] = (key, it.turn, w)
        if w == worker:
            yield dataclasses.replace(it, key=key, after=after)
