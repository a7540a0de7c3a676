"""Every workload's requests, as `Item`s: the synthetic chat stream
(`synthetic`, shared system prompts and multi-turn conversations), the RAG
shape (`rag`: documents each asked several questions), JSONL files
(`load_jsonl` / `write_jsonl`), conversations in waves of turns
(`conversations`, scripts/bench_vllm.py's chat), the vLLM plugin tests'
shared prefixes with duplicates (`shared_prefix`) and the compute-free
scheduler's system prompts (`system_prompts`).  `kvshm run`'s workers,
the vLLM engine driver (kvshm/vllm/engine.py, `workload_json`) and the
benchmarks all take them from here.

Every process that builds the same stream gets the same items (no use of
`hash()`, so PYTHONHASHSEED does not matter), which lets each worker generate
the whole stream and keep its share (workers/turns.py, `assign`) without
talking to the others.
"""

from __future__ import annotations

import dataclasses

import hashlib
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Item:
    """One request.

    `output` holds the tokens the "model" produces in decode (teacher-forced),
    so that the next turn of the conversation, whose prompt contains them, can
    hit blocks cached during decode.  `turn` counts from 0 per conversation.
    """

    rid: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    conversation: str
    turn: int
    # Set by `assign` (workers/turns.py): the conversation's number in order
    # of first appearance, and the worker serving its previous turn (-1:
    # none), whose answer this turn waits for.
    key: int = -1
    after: int = -1


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of the synthetic chat workload (lengths in tokens).

    Lengths drawn "lognormal" are `median * exp(sigma * N(0, 1))`, rounded and
    clipped to their (min, max); turns per conversation are geometric with
    mean `mean_turns` (before the cap `max_turns` and the `max_len` cut).
    """

    seed: int = 0
    vocab: int = 32000
    num_system_prompts: int = 3
    system_len: tuple[int, int] = (1000, 3000)  # uniform
    share_system: float = 0.8                   # conversations opening with a shared prompt
    system_skew: float = 1.2                    # Zipf exponent of system prompt popularity
    user_len: tuple[int, int] = (16, 1024)
    user_median: float = 120.0
    output_len: tuple[int, int] = (8, 512)
    output_median: float = 16.0
    sigma: float = 0.9                          # spread of both lognormals
    mean_turns: float = 2.5
    max_turns: int = 8
    max_len: int = 8192                         # prompt + output of every item
    open_conversations: int = 16                # interleaved at any time

    def fit(self, max_len: int) -> SyntheticSpec:
        """This spec for a model of `max_len` tokens: lengths (ranges and
        medians) scaled down in proportion when the longest first turn
        would not fit, unchanged otherwise.  Raises ValueError below 64."""
        if max_len < 64:
            raise ValueError(f"max_len {max_len} is too short for chat traffic (>= 64)")
        longest = ((self.system_len[1] if self.share_system > 0 else 0)
                   + self.user_len[1] + self.output_len[1])
        if longest <= max_len:
            return dataclasses.replace(self, max_len=max_len)
        f = max_len / longest

        def scaled(lo_hi, lo_min):
            lo, hi = lo_hi
            hi = max(lo_min, int(hi * f))
            return (min(max(lo_min, int(lo * f)), hi), hi)

        return dataclasses.replace(
            self, max_len=max_len, system_len=scaled(self.system_len, 1),
            user_len=scaled(self.user_len, 1), output_len=scaled(self.output_len, 1),
            user_median=max(1.0, self.user_median * f),
            output_median=max(1.0, self.output_median * f))

    def validate(self) -> SyntheticSpec:
        """Check the fields.

        Returns:
            self, for chaining.
        Raises:
            ValueError: a field out of range (its value is in the message), or
                a `max_len` too small for the longest first turn.
        """
        def bounds(name: str, lo_min: int) -> None:
            lo, hi = getattr(self, name)
            if not (isinstance(lo, int) and isinstance(hi, int) and lo_min <= lo <= hi):
                raise ValueError(f"{name} must be ints ({lo_min} <= min <= max), "
                                 f"got {(lo, hi)!r}")

        if self.vocab < 1:
            raise ValueError(f"vocab must be >= 1, got {self.vocab}")
        if self.num_system_prompts < 0:
            raise ValueError(f"num_system_prompts must be >= 0, got {self.num_system_prompts}")
        if not 0.0 <= self.share_system <= 1.0:
            raise ValueError(f"share_system must be in [0, 1], got {self.share_system}")
        if self.share_system > 0 and self.num_system_prompts == 0:
            raise ValueError(f"share_system={self.share_system} needs system prompts, "
                             f"num_system_prompts is 0")
        if self.system_skew < 0:
            raise ValueError(f"system_skew must be >= 0, got {self.system_skew}")
        bounds("system_len", 1)
        bounds("user_len", 1)
        bounds("output_len", 0)
        for name in ("user_median", "output_median", "mean_turns"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")
        if self.mean_turns < 1:
            raise ValueError(f"mean_turns must be >= 1, got {self.mean_turns}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.open_conversations < 1:
            raise ValueError(f"open_conversations must be >= 1, got {self.open_conversations}")
        longest = ((self.system_len[1] if self.share_system > 0 else 0)
                   + self.user_len[1] + self.output_len[1])
        if self.max_len < longest:
            raise ValueError(f"max_len {self.max_len} is below the longest first turn, "
                             f"{longest} tokens (system + user + output maxima)")
        return self


class _Conversation:
    __slots__ = ("num", "turn", "turns_left", "context")

    def __init__(self, num: int, turns: int, context: tuple[int, ...]) -> None:
        self.num = num
        self.turn = 0
        self.turns_left = turns
        self.context = context    # the previous turn's prompt + output


def synthetic(spec: SyntheticSpec = SyntheticSpec()) -> Iterator[Item]:
    """An infinite, deterministic stream of chat requests.

    `spec.open_conversations` conversations are open at a time; each item is
    the next turn of one of them, picked at random, and a finished
    conversation is replaced by a new one.  A conversation opens with one of
    the shared system prompts (probability `share_system`, Zipf-weighted)
    plus user tokens, or with user tokens only; turn k+1's prompt is turn k's
    prompt + turn k's output + new user tokens.  A conversation ends after its
    drawn number of turns or when the next turn would not fit in `max_len`.

    Args:
        spec: the workload shape.
    Returns:
        An iterator of `Item`s with ids "c<conversation>-t<turn>"; the same
        spec yields the same items in every process.
    Raises:
        ValueError: an invalid spec (raised by this call, not on first next()).
    """
    spec.validate()
    return _synthetic(spec)


def _synthetic(spec: SyntheticSpec) -> Iterator[Item]:
    rng = random.Random(spec.seed)
    vocab = range(spec.vocab)
    systems = [tuple(rng.choices(vocab, k=rng.randint(*spec.system_len)))
               for _ in range(spec.num_system_prompts)]
    weights = [1.0 / (k + 1) ** spec.system_skew for k in range(spec.num_system_prompts)]
    p_stop = 1.0 / spec.mean_turns

    def lognormal(median: float, lo_hi: tuple[int, int]) -> int:
        x = round(median * math.exp(spec.sigma * rng.gauss(0.0, 1.0)))
        return min(max(x, lo_hi[0]), lo_hi[1])

    def user() -> tuple[int, ...]:
        return tuple(rng.choices(vocab, k=lognormal(spec.user_median, spec.user_len)))

    def output() -> tuple[int, ...]:
        return tuple(rng.choices(vocab, k=lognormal(spec.output_median, spec.output_len)))

    next_num = 0

    def open_conversation() -> _Conversation:
        nonlocal next_num
        turns = 1
        while turns < spec.max_turns and rng.random() >= p_stop:
            turns += 1
        opening: tuple[int, ...] = ()
        if rng.random() < spec.share_system:
            opening = rng.choices(systems, weights)[0]
        conv = _Conversation(next_num, turns, opening)
        next_num += 1
        return conv

    open_ = [open_conversation() for _ in range(spec.open_conversations)]
    while True:
        slot = rng.randrange(len(open_))
        conv = open_[slot]
        prompt = conv.context + user()
        out = output()
        if conv.turn > 0 and len(prompt) + len(out) > spec.max_len:
            # The conversation outgrew max_len: close it, serve a fresh one
            # (whose first turn fits, by validate()).
            conv = open_[slot] = open_conversation()
            prompt = conv.context + user()
            out = output()
        yield Item(f"c{conv.num}-t{conv.turn}", prompt, out, f"c{conv.num}", conv.turn)
        conv.turn += 1
        conv.turns_left -= 1
        conv.context = prompt + out
        if conv.turns_left == 0:
            open_[slot] = open_conversation()


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text`, the same in every process (blake2b)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def tokenize(text: str, vocab: int = 32000) -> tuple[int, ...]:
    """A trivial tokenizer: one token per whitespace-separated word.

    Args:
        text: the text.
        vocab: ids are in [0, vocab).
    Returns:
        The ids; a word always maps to the same id (blake2b, independent of
        PYTHONHASHSEED and of the process).
    Raises:
        ValueError: vocab < 1.
    """
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    return tuple(stable_hash(word) % vocab for word in text.split())


def drawn_output(rid: str, n: int, vocab: int) -> tuple[int, ...]:
    """`n` output tokens for request `rid` where a workload gives only a
    length: drawn from a generator seeded by the id (the same everywhere)."""
    gen = random.Random(f"output:{rid}")     # str seeds hash with sha512
    return tuple(gen.choices(range(vocab), k=n))


def _ids(value: object, key: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: {key!r} must be a list of token ids, "
                         f"got {type(value).__name__}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{where}: {key}[{i}] is {t!r}, not an int token id")
        if t < 0:
            raise ValueError(f"{where}: {key}[{i}] is {t}, a negative token id")
    return tuple(value)


def load_jsonl(path: str | Path, *, vocab: int = 32000, default_output_len: int = 64,
               max_len: int = 4096) -> list[Item]:
    """Load requests from a JSON-lines file.

    Each non-blank line is an object with the prompt as "prompt_ids" (a list
    of ints >= 0) or "prompt" (text, see `tokenize`), and optionally
    "output_ids" or "output_len" (default `default_output_len`; the tokens
    are then drawn from a generator seeded by the item's id), "id" (default
    "l<line number>") and "conversation" (default the id; items of one
    conversation are numbered as turns 0, 1, ... in file order).  Other keys
    are ignored.

    Args:
        path: the file.
        vocab: id range of `tokenize` and of generated outputs (ids given in
            the file are not checked against it).
        default_output_len: output length when a line gives none.
        max_len: the most tokens (prompt + output) one item may hold.
    Returns:
        The items in file order.
    Raises:
        ValueError: bad arguments, or a bad line: invalid JSON, not an
            object, no prompt or both kinds, non-int or negative ids, an empty
            prompt, a bad output_len, both output kinds, a non-string or
            duplicate id, or prompt + output over max_len; the message starts
            with "<path>:<line>:".
        OSError: the file cannot be read.
    """
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    if default_output_len < 0:
        raise ValueError(f"default_output_len must be >= 0, got {default_output_len}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    items: list[Item] = []
    first_seen: dict[str, int] = {}
    turns: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON: {e.msg} "
                                 f"(column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")

            rid = obj.get("id", f"l{lineno}")
            if not isinstance(rid, str) or not rid:
                raise ValueError(f"{where}: 'id' must be a non-empty string, got {rid!r}")
            if rid in first_seen:
                raise ValueError(f"{where}: duplicate id {rid!r} (first on line "
                                 f"{first_seen[rid]})")
            conversation = obj.get("conversation", rid)
            if not isinstance(conversation, str) or not conversation:
                raise ValueError(f"{where}: 'conversation' must be a non-empty string, "
                                 f"got {conversation!r}")

            if "prompt_ids" in obj and "prompt" in obj:
                raise ValueError(f"{where}: give either 'prompt_ids' or 'prompt', not both")
            if "prompt_ids" in obj:
                prompt = _ids(obj["prompt_ids"], "prompt_ids", where)
            elif "prompt" in obj:
                if not isinstance(obj["prompt"], str):
                    raise ValueError(f"{where}: 'prompt' must be a string, "
                                     f"got {type(obj['prompt']).__name__}")
                prompt = tokenize(obj["prompt"], vocab)
            else:
                raise ValueError(f"{where}: no prompt (need 'prompt_ids' or 'prompt')")
            if not prompt:
                raise ValueError(f"{where}: empty prompt")

            if "output_ids" in obj and "output_len" in obj:
                raise ValueError(f"{where}: give either 'output_ids' or 'output_len', not both")
            if "output_ids" in obj:
                output = _ids(obj["output_ids"], "output_ids", where)
            else:
                n = obj.get("output_len", default_output_len)
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ValueError(f"{where}: 'output_len' must be an int >= 0, got {n!r}")
                output = drawn_output(rid, n, vocab)

            if len(prompt) + len(output) > max_len:
                raise ValueError(f"{where}: prompt ({len(prompt)}) + output ({len(output)}) "
                                 f"= {len(prompt) + len(output)} tokens, over max_len {max_len}")
            first_seen[rid] = lineno
            turn = turns.get(conversation, 0)
            turns[conversation] = turn + 1
            items.append(Item(rid, prompt, output, conversation, turn))
    return items


@dataclass(frozen=True)
class RagSpec:
    """Shape of a retrieval-augmented workload (lengths in tokens, uniform):
    `num_docs` documents, each asked `questions` questions in a row, every
    prompt a document followed by its question.  Consecutive requests share
    a document, so split round robin they reach every worker together: the
    case where engines with their own caches compute a document each, and
    one pool can compute it once.  `shared=False` gives every prompt a
    document of its own (the same lengths, nothing to share)."""

    seed: int = 0
    vocab: int = 32000
    num_docs: int = 6
    questions: int = 6
    doc_len: tuple[int, int] = (800, 1500)
    question_len: tuple[int, int] = (16, 64)
    output_len: int = 16
    shared: bool = True

    def validate(self) -> RagSpec:
        _check_fields(self, {"num_docs": 1, "questions": 1, "output_len": 0},
                      {"doc_len": 1, "question_len": 1})
        if self.vocab < 1:
            raise ValueError(f"vocab must be >= 1, got {self.vocab}")
        return self

    @property
    def max_item_len(self) -> int:
        return self.doc_len[1] + self.question_len[1] + self.output_len


def rag(spec: RagSpec = RagSpec()) -> Iterator[Item]:
    """The `num_docs * questions` requests of `spec`, document by document,
    ids "d<doc>-q<question>" (each its own conversation); deterministic.
    Raises ValueError for an invalid spec (at this call)."""
    spec.validate()
    return _rag(spec)


def _rag(spec: RagSpec) -> Iterator[Item]:
    rng = random.Random(spec.seed)
    vocab = range(spec.vocab)
    doc: tuple[int, ...] = ()
    for d in range(spec.num_docs):
        for q in range(spec.questions):
            if q == 0 or not spec.shared:
                doc = tuple(rng.choices(vocab, k=rng.randint(*spec.doc_len)))
            question = tuple(rng.choices(vocab, k=rng.randint(*spec.question_len)))
            out = tuple(rng.choices(vocab, k=spec.output_len))
            rid = f"d{d}-q{q}"
            yield Item(rid, doc + question, out, rid, 0)


def conversations(num: int, turns: int, system_prompts: int, system_len: int, *,
                  seed: int = 0, vocab: int = 1000) -> Iterator[Item]:
    """`num` conversations of `turns` turns each over `system_prompts` shared
    system prompts of `system_len` tokens, conversation by conversation:
    turn k's prompt is turn k-1's prompt + its answer (`output`, 32-96
    tokens) + 64-160 new user tokens.  Ids "c<conversation>-t<turn>"; token
    ids from 3 (0-2 stay clear of a model's special ids); deterministic."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(system_len)]
               for _ in range(system_prompts)]
    for c in range(num):
        prompt = list(rng.choice(systems))
        for k in range(turns):
            prompt += [rng.randrange(3, vocab) for _ in range(rng.randrange(64, 160))]
            answer = tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(32, 96)))
            yield Item(f"c{c}-t{k}", tuple(prompt), answer, f"c{c}", k)
            prompt += answer


def shared_prefix(seed: int = 3, num_requests: int = 14, *, vocab: int = 1000,
                  prefix_lens: tuple[int, ...] = (150, 90)) -> list[Item]:
    """Requests over a few shared system prompts (`prefix_lens` tokens each,
    request i on prompt i mod their number) with unique tails of 5-79
    tokens and outputs of 8-39, then exact duplicates of requests 0 and 3
    ("dup0" with 12 output tokens, "dup3" with 30); token ids from 3.
    Raises ValueError below 4 requests (dup3 needs request 3)."""
    if num_requests < 4:
        raise ValueError(f"num_requests must be >= 4, got {num_requests}")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(n)] for n in prefix_lens]
    items = []
    for i in range(num_requests):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 80))]
        rid = f"r{i}"
        n = rng.randrange(8, 40)
        items.append(Item(rid, tuple(prefixes[i % len(prefixes)] + tail),
                          drawn_output(rid, n, vocab), rid, 0))
    for rid, of, n in (("dup0", 0, 12), ("dup3", 3, 30)):
        items.append(Item(rid, items[of].prompt, drawn_output(rid, n, vocab), rid, 0))
    return items


@dataclass(frozen=True)
class SystemPromptSpec:
    """The compute-free scheduler's requests (kvshm demo, the service
    benchmark): `num_requests` prompts, each one of `num_system_prompts`
    shared system prompts followed by a user part, with an answer of
    `output_len` tokens (lengths uniform, in tokens; every item cut to
    `max_len`, its prompt to `max_len - 1`)."""

    seed: int = 0
    vocab: int = 32000
    num_requests: int = 200
    num_system_prompts: int = 4
    system_len: tuple[int, int] = (200, 600)
    user_len: tuple[int, int] = (20, 200)
    output_len: tuple[int, int] = (16, 128)
    max_len: int = 4096

    def validate(self) -> SystemPromptSpec:
        _check_fields(self, {"num_requests": 0, "num_system_prompts": 1, "vocab": 1,
                             "max_len": 2},
                      {"system_len": 0, "user_len": 0, "output_len": 0})
        return self


def _check_fields(spec, ints: dict[str, int], ranges: dict[str, int]) -> None:
    """Raise ValueError unless each field of `ints` is an int >= its bound
    and each of `ranges` is (lo, hi) with bound <= lo <= hi."""
    for name, low in ints.items():
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    for name, low in ranges.items():
        lo, hi = getattr(spec, name)
        if not low <= lo <= hi:
            raise ValueError(f"{name} must be (lo, hi) with {low} <= lo <= hi, got {(lo, hi)}")


def system_prompts(spec: SystemPromptSpec = SystemPromptSpec()) -> Iterator[Item]:
    """The requests of `spec` in arrival order, ids "0", "1", ... (each its
    own conversation); deterministic.  The prompts are drawn from one
    generator seeded by `spec.seed` (the system prompts first, then per
    request its system prompt, its user part and its answer's length), the
    answers by `drawn_output`.  Raises ValueError for an invalid spec (at
    this call)."""
    spec.validate()
    return _system_prompts(spec)


def _system_prompts(spec: SystemPromptSpec) -> Iterator[Item]:
    rng = random.Random(spec.seed)
    systems = [[rng.randrange(spec.vocab) for _ in range(rng.randint(*spec.system_len))]
               for _ in range(spec.num_system_prompts)]
    for i in range(spec.num_requests):
        prompt = list(rng.choice(systems)) + [
            rng.randrange(spec.vocab) for _ in range(rng.randint(*spec.user_len))]
        prompt = prompt[:spec.max_len - 1]
        n = min(len(prompt) + rng.randint(*spec.output_len), spec.max_len) - len(prompt)
        rid = str(i)
        yield Item(rid, tuple(prompt), drawn_output(f"{spec.seed}:{rid}", n, spec.vocab),
                   rid, 0)


def write_jsonl(items: Iterable[Item], path: str | Path) -> int:
    """Write `items` as a workload file `load_jsonl` reads back as the same
    items (prompt and output ids, id, conversation); returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps({"id": it.rid, "prompt_ids": list(it.prompt),
                                "output_ids": list(it.output),
                                "conversation": it.conversation}, separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


def distinct_tokens(items: Iterable[Item]) -> int:
    """Tokens whose K/V a perfect prefix cache computes once for `items`:
    the positions of distinct prefixes of every prompt + output (but the
    last output token, which is sampled, never computed)."""
    root: dict = {}
    n = 0
    for it in items:
        node = root
        for t in it.prompt + it.output[:-1]:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                n += 1
            node = nxt
    return n


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start, the first at 0) of `n`
    requests of an open-loop Poisson stream of `rate` requests a second:
    exponential gaps drawn from `seed`; deterministic.  Raises ValueError
    unless n >= 0 and rate > 0."""
    if n < 0 or not rate > 0 or math.isinf(rate):
        raise ValueError(f"need n >= 0 and a finite rate > 0, got n={n}, rate={rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out
