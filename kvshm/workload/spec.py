"""`WorkloadSpec`: which requests a run serves, as one value a launcher can
send its workers (msgspec), and `workload_stream`, its items in order.

`kvshm run`'s workers and the compute-free scheduler (scheduler.py: `kvshm
demo`, the service benchmark) take the same spec; each of its kinds is one
generator of items.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Literal

import msgspec

from kvshm.workload.items import (Item, RagSpec, SyntheticSpec, SystemPromptSpec, load_jsonl,
                                  rag, synthetic, system_prompts)


class WorkloadSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The requests of a run, the same for every worker, which takes its
    share (`assign`: "round-robin" or "hash", which keeps a conversation on
    one worker).  `kind` "synthetic" generates `synthetic`'s chat traffic;
    "rag" the documents and questions of `rag` (items.rag); "system" the
    compute-free scheduler's system prompts of `system` (items.system_prompts);
    "jsonl" reads prompts from `path` (token ids below `vocab`, cut to
    `max_len`).  `limit`: only the first `limit` requests of the whole
    workload."""

    kind: Literal["synthetic", "rag", "system", "jsonl"] = "synthetic"
    synthetic: SyntheticSpec = SyntheticSpec()
    rag: RagSpec = RagSpec()
    system: SystemPromptSpec = SystemPromptSpec()
    path: str = ""
    vocab: int = 32000
    max_len: int = 4096
    limit: int | None = None
    assign: Literal["round-robin", "hash"] = "round-robin"


def workload_stream(workload: WorkloadSpec) -> Iterator[Item]:
    """Every item of the workload, in order (infinite for an unlimited
    synthetic one).  Raises ValueError for an invalid kind's spec, OSError
    or ValueError for an unreadable JSONL file."""
    if workload.kind == "synthetic":
        items = synthetic(workload.synthetic)
    elif workload.kind == "rag":
        items = rag(workload.rag)
    elif workload.kind == "system":
        items = system_prompts(workload.system)
    else:
        items = iter(load_jsonl(workload.path, vocab=workload.vocab, max_len=workload.max_len))
    if workload.limit is not None:
        items = itertools.islice(items, workload.limit)
    return items
