"""Crashes at every line: a forked writer runs the coordinator's frames
(sans-IO: the executor on a pool it created) and `os._exit`s at the N-th
line of kvshm's code it executes inside one frame, as a SIGKILL between two
statements would; this process then adopts the pool as a restarted
coordinator does and checks that it is exactly as the last committed frame
left it (or as the cut-off frame left it, when the crash came after its
commit): the same request table and session seqs, the kept replies intact,
no block cached that was cached in neither state, the invariant check clean.

test_crash_points.py crashes a real coordinator at method boundaries; this
sweep reaches the statements inside those methods (a flag set before its
stamp was one such bug: the pool could not be adopted).  Bounded in CI:
each distinct line the script reaches under any of the configs, at its
first execution before and after its frame journals its first undo entry
(what repair tells apart), in the first config (by name) that reaches it:
about 1,700 cases, a minute.  KVSHM_CRASH_LINES=configs: each config's own
distinct lines (about 6,600 cases, 4 minutes); =frames: each distinct line
of each frame of each config; =all: every line event of every frame.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import msgspec
import pytest

from helpers import make_config, tokens
from kvshm import FullSpec, MLASpec, SlidingWindowSpec
from kvshm.core.faults import CRASH_EXIT_CODE
from kvshm.core.state import UNDO_LEN_WORD
from kvshm.ops import protocol as p
from kvshm.ops.executor import OpExecutor
from kvshm.ops.sessions import REPLIES_KEPT
from kvshm.pool.lifecycle import adopt_pool, create_pool
from kvshm.pool.segment import remove_segment, segment_info

KVSHM_DIR = str(Path(__import__("kvshm").__file__).parent)
CONFIGS = {
    "full": make_config(num_blocks=40, max_num_seqs=8),
    "hybrid": make_config(groups=(FullSpec(4), SlidingWindowSpec(4, 8)), num_blocks=48,
                          max_num_seqs=8),
    # vLLM 0.32's semantics: freed blocks without a hash go to the head of
    # the free queue (stamps counting down), admissions pass the gate.
    "full-0.32": make_config(num_blocks=40, max_num_seqs=8, vllm_version="0.32.0",
                             watermark=0.05),
    "hybrid-0.32": make_config(groups=(FullSpec(4), SlidingWindowSpec(4, 8)), num_blocks=48,
                               max_num_seqs=8, vllm_version="0.32.0", max_in_flight_tokens=8),
    # Full-attention blocks of two hash blocks (MLA's set the hash block),
    # with EAGLE: partial prefix entries, alone on a block ("a"'s block 2)
    # and beside a full one.
    "partial-0.32": make_config(groups=(FullSpec(8), MLASpec(4), SlidingWindowSpec(8, 16)),
                                num_blocks=64, max_num_seqs=8, vllm_version="0.32.0",
                                use_eagle=True, max_in_flight_tokens=8),
}
# "lines" (CI): the first event of each distinct line of the script, before
# and after its frame's first undo entry, in the first config that reaches
# it; "configs": the same in every config; "frames": of each such line of
# each frame; "all": every line event.
SWEEPS = ("lines", "configs", "frames", "all")
SWEEP = os.environ.get("KVSHM_CRASH_LINES", "lines")
if SWEEP not in SWEEPS:
    raise ValueError(f"KVSHM_CRASH_LINES={SWEEP!r}: want one of {', '.join(SWEEPS)}")


def _frames() -> list:
    """The script: (session, message) frames, or (session, None) for the
    end of that session.  Session 0 is an admin; every writing op occurs,
    and blocks are cached pending, made ready, dropped while pending,
    evicted, reported corrupt and reset."""
    batch = p.Batch
    return [
        (0, p.AddRequest("a", tokens(0, 22))),
        (0, p.GetComputedBlocks("a")),
        (0, p.AllocateSlots("a", 22)),
        (0, p.Advance("a", 22, [500])),
        (1, batch([p.AddRequest("d1", tokens(0, 13)), p.GetComputedBlocks("d1")])),
        (0, batch([p.AddRequest("b", tokens(0, 22) + [500]), p.Admit("b", 30)])),
        (0, batch([p.Advance("b", 23, [501]), p.AllocateSlots("b", 1),
                   p.CacheBlocks("b", 24)])),
        (0, p.Free("b", preempted=True)),
        (1, batch([p.AddRequest("d2", tokens(200, 215)), p.NewStepStarts(),
                   p.AllocateSlots("d2", 15, full_sequence_must_fit=True, waiting=True),
                   p.EstimateCachedTokens("d2")])),
        (0, batch([p.AddRequest("e", tokens(200, 215)), p.GetComputedBlocks("e")])),
        (0, p.AllocateSlots("a", 1, delay_cache_blocks=True)),
        (0, p.RemoveSkippedBlocks("a", 23)),
        (0, p.ReportCorrupt("a", [2])),
        (0, p.EvictBlocks([1, 3])),
        (1, p.Free("d2")),
        (1, None),
        (0, p.Free("a")),
        (0, p.ResetPrefixCache()),
        (0, batch([p.AddRequest("f", tokens(0, 22)), p.GetComputedBlocks("f"),
                   p.AllocateSlots("f", 22)])),
    ]


def _run_frame(ex: OpExecutor, owners: list, frame) -> bytes:
    who, msg = frame
    if msg is None:
        ex.lifecycle.close(owners[who])
        return b""
    return bytes(ex.execute_frame(owners[who], msg))


def _open(cfg, name: str):
    pool = create_pool(cfg, name)
    ex = OpExecutor(pool.mgr, resumable=True)
    owners = [ex.lifecycle.open(1, admin=True), ex.lifecycle.open(2)]
    return pool, ex, owners


def _snapshot(mgr, ex) -> dict:
    """What must survive: each request's rows (ids and cached counts per
    group) and owner, each session's last applied seq, the cached blocks
    and partial entries."""
    table = mgr.table
    groups = range(len(mgr.config.groups))
    rows = {rid: (table.owner(slot), tuple(table.read_row(slot, g) for g in groups))
            for rid, slot in table.slot_of.items()}
    seqs = {r.session_id: r.last_seq for r in ex.sessions.records()}
    pool = mgr.block_pool
    cached = set(pool.cached_blocks()) | {("partial", *e) for e in pool.partial_entries()}
    return {"rows": rows, "seqs": seqs, "cached": cached}


def _tracer(stop_at: int | None, lines: list | None, words=None):
    """A trace function for kvshm's code: counts its line events, records
    them into `lines` (file, line, whether the frame has journaled nothing
    yet: repair treats the two apart), or ends the process at event
    `stop_at`."""
    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == stop_at:
                os._exit(CRASH_EXIT_CODE)
            if lines is not None:
                lines.append((frame.f_code.co_filename, frame.f_lineno,
                              not words[UNDO_LEN_WORD]))
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(KVSHM_DIR) else None
    return calls


def _reference(cfg) -> tuple[list, list, list]:
    """Run the script in-process: the state before each frame and after the
    last, each frame's reply, and each frame's line events."""
    name = f"kvshm-test-{secrets.token_hex(5)}"
    pool, ex, owners = _open(cfg, name)
    states, replies, traces = [_snapshot(pool.mgr, ex)], [], []
    try:
        for frame in _frames():
            lines: list = []
            sys.settrace(_tracer(None, lines, pool.mgr.segment.words))
            try:
                replies.append(_run_frame(ex, owners, frame))
            finally:
                sys.settrace(None)
            traces.append(lines)
            states.append(_snapshot(pool.mgr, ex))
    finally:
        pool.close()
    return states, replies, traces


REFERENCE = {k: _reference(cfg) for k, cfg in CONFIGS.items()}


def _cases(kind: str) -> list[tuple[int, int]]:
    """(frame, line event) pairs to crash at, as SWEEP says."""
    out = []
    seen: set = set()
    if SWEEP == "lines":   # the lines a config before this one reaches are done there
        names = sorted(CONFIGS)
        for other in names[:names.index(kind)]:
            for lines in REFERENCE[other][2]:
                seen.update(lines)
    for i, lines in enumerate(REFERENCE[kind][2]):
        if SWEEP == "frames":
            seen = set()
        for n, line in enumerate(lines, 1):
            if SWEEP == "all" or line not in seen:
                seen.add(line)
                out.append((i, n))
    return out


def _crash_at(cfg, name: str, frame: int, event: int) -> int:
    """Fork a writer that runs the script and dies at line event `event`
    of frame `frame`; its exit status."""
    pid = os.fork()
    if pid == 0:   # the writer: never returns into pytest
        try:
            pool, ex, owners = _open(cfg, name)
            for i, f in enumerate(_frames()):
                if i == frame:
                    sys.settrace(_tracer(event, None))
                _run_frame(ex, owners, f)
                sys.settrace(None)
            os._exit(0)
        except BaseException:   # noqa: BLE001 (reported as the status)
            import traceback
            traceback.print_exc()
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _check_adopted(kind: str, cfg, name: str, frame: int) -> None:
    states, replies, _ = REFERENCE[kind]
    before, after = states[frame], states[frame + 1]
    pool = adopt_pool(cfg, name)      # raises if the pool cannot be repaired
    try:
        ex = OpExecutor(pool.mgr, resumable=True)
        ex.lifecycle.adopt()
        got = _snapshot(pool.mgr, ex)
        assert got["rows"] in (before["rows"], after["rows"])
        done = got["rows"] == after["rows"] and got["rows"] != before["rows"]
        want = after if done else before
        if got["seqs"] != want["seqs"]:   # rows unchanged by the frame: its seq tells
            want = after if got["seqs"] == after["seqs"] else before
        assert got["seqs"] == want["seqs"]
        assert got["cached"] <= before["cached"] | after["cached"], \
            "a block is cached that neither state cached"
        # Every reply a session's record still keeps is the one it sent.
        by_session = {r.session_id: r for r in ex.sessions.records()}
        sent = _replies_by_session(replies)
        for sid, rec in by_session.items():
            for seq in range(max(1, rec.last_seq - REPLIES_KEPT + 1), rec.last_seq + 1):
                assert ex.sessions.reply(rec.slot, seq) == sent[sid][seq - 1], (sid, seq)
    finally:
        pool.close()


def _replies_by_session(replies: list) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {1: [], 2: []}
    for (who, msg), reply in zip(_frames(), replies):
        if msg is not None:
            out[who + 1].append(reply)
    return out


# Each config's cases in PARTS tests, every PARTS-th case each: a part of a
# minute at most, so that the test processes of ./scripts/test.sh share them.
PARTS = 4


@pytest.mark.parametrize("kind,part", [(k, i) for k in sorted(CONFIGS) for i in range(PARTS)],
                         ids=[f"{k}-{i + 1}of{PARTS}" for k in sorted(CONFIGS)
                              for i in range(PARTS)])
def test_a_crash_at_any_line_of_a_frame_leaves_an_adoptable_pool(kind, part):
    cfg = CONFIGS[kind]
    cases = _cases(kind)[part::PARTS]
    failures = []
    for frame, event in cases:
        name = f"kvshm-test-{secrets.token_hex(5)}"
        try:
            code = _crash_at(cfg, name, frame, event)
            assert code == CRASH_EXIT_CODE, f"the writer exited {code}, not at the crash"
            _check_adopted(kind, cfg, name, frame)
        except Exception as e:  # noqa: BLE001 (collected: the report names every case)
            failures.append(f"frame {frame} ({_describe(frame)}), line event {event} "
                            f"({_line(kind, frame, event)}): {type(e).__name__}: {e}")
        finally:
            for n in (name, f"{name}-kv"):
                if segment_info(n) is not None:
                    remove_segment(n, force=True)
    print(f"\n{kind}, part {part + 1} of {PARTS}: {len(cases)} crashes over "
          f"{len(_frames())} frames")
    assert not failures, f"{len(failures)} of {len(cases)} crashes:\n" + "\n".join(failures[:20])


def _describe(frame: int) -> str:
    who, msg = _frames()[frame]
    if msg is None:
        return f"session {who + 1} ends"
    return msgspec.json.encode(msg).decode()[:80]


def _line(kind: str, frame: int, event: int) -> str:
    path, line, _ = REFERENCE[kind][2][frame][event - 1]
    return f"{os.path.relpath(path, os.path.dirname(KVSHM_DIR))}:{line}"
