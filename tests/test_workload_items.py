"""kvshm.workload.items: the synthetic chat stream (determinism, shared prefixes,
lengths), JSONL traces with their errors, and splitting a stream among workers."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from kvshm.workers.turns import assign
from kvshm.workload.items import (Item, RagSpec, SyntheticSpec, conversations, distinct_tokens,
    load_jsonl, poisson_arrivals, rag, shared_prefix, synthetic, tokenize, write_jsonl)

DATA = Path(__file__).parent / "data"

N = 2000


def take(n: int, spec: SyntheticSpec = SyntheticSpec()) -> list[Item]:
    return list(itertools.islice(synthetic(spec), n))


@pytest.fixture(scope="module")
def stream() -> list[Item]:
    return take(N)


def digest(items) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(repr((it.rid, it.prompt, it.output, it.conversation, it.turn)).encode())
    return h.hexdigest()


def system_prefix(item: Item, systems) -> tuple[int, ...] | None:
    return next((s for s in systems if item.prompt[:len(s)] == s), None)


@pytest.fixture(scope="module")
def systems(stream):
    """The shared system prompts, recovered from the stream: the longest common
    prefix of the first turns of two conversations, where that is long."""
    firsts = [it.prompt for it in stream if it.turn == 0]
    found = set()
    for a, b in itertools.combinations(firsts[:60], 2):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        if n >= SyntheticSpec().system_len[0]:
            found.add(a[:n])
    return sorted(found, key=len, reverse=True)


# -- synthetic: determinism -------------------------------------------------

def test_same_seed_same_items_other_seed_differs(stream):
    assert take(500) == stream[:500]
    other = take(500, SyntheticSpec(seed=1))
    assert other != stream[:500]
    assert [it.prompt for it in other[:20]] != [it.prompt for it in stream[:20]]


def test_same_items_in_a_process_with_another_hash_seed(stream):
    code = ("import itertools, hashlib, sys\n"
            "from kvshm.workload.items import synthetic, SyntheticSpec, tokenize\n"
            "h = hashlib.sha256()\n"
            "for it in itertools.islice(synthetic(SyntheticSpec()), 500):\n"
            "    h.update(repr((it.rid, it.prompt, it.output, it.conversation, "
            "it.turn)).encode())\n"
            "print(h.hexdigest(), tokenize('the same words map the same', 32000))\n")
    outs = set()
    for hash_seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout
        outs.add(out)
    assert outs == {f"{digest(stream[:500])} {tokenize('the same words map the same', 32000)}\n"}


def test_stream_is_infinite_and_ids_unique():
    items = take(2 * N, SyntheticSpec(seed=3))
    assert len(items) == 2 * N
    assert len({it.rid for it in items}) == len(items)
    assert all(it.rid == f"{it.conversation}-t{it.turn}" for it in items)


# -- synthetic: prefixes ----------------------------------------------------

def test_system_prompts_are_shared(stream, systems):
    spec = SyntheticSpec()
    assert len(systems) == spec.num_system_prompts
    assert all(spec.system_len[0] <= len(s) <= spec.system_len[1] for s in systems)
    firsts = [it for it in stream if it.turn == 0]
    with_system = [it for it in firsts if system_prefix(it, systems)]
    share = len(with_system) / len(firsts)
    assert 0.7 <= share <= 0.9, share           # share_system = 0.8
    # skewed popularity: the most used prompt is used clearly more than the least
    uses = sorted(sum(1 for it in with_system if system_prefix(it, systems) == s)
                  for s in systems)
    assert uses[-1] > 1.5 * uses[0], uses
    # and many items overall (later turns too) start with one
    assert sum(1 for it in stream if system_prefix(it, systems)) >= 0.7 * len(stream)


def test_later_turns_extend_earlier_prompt_and_output(stream):
    by_conv: dict[str, list[Item]] = {}
    for it in stream:
        by_conv.setdefault(it.conversation, []).append(it)
    multi = [turns for turns in by_conv.values() if len(turns) > 1]
    assert len(multi) >= 100
    for turns in by_conv.values():
        assert [it.turn for it in turns] == list(range(len(turns)))   # in order, no gap
        for prev, nxt in itertools.pairwise(turns):
            context = prev.prompt + prev.output
            assert nxt.prompt[:len(context)] == context
            assert len(nxt.prompt) > len(context)    # new user tokens


def test_conversations_interleave(stream):
    # a conversation's next turn usually comes some items after its previous one
    last_seen, gaps = {}, []
    for i, it in enumerate(stream):
        if it.turn > 0:
            gaps.append(i - last_seen[it.conversation])
        last_seen[it.conversation] = i
    assert statistics.median(gaps) > 1
    open_at_once = max(len({it.conversation for it in stream[i:i + 50]})
                       for i in range(0, N - 50, 50))
    assert open_at_once >= 8


# -- synthetic: lengths -----------------------------------------------------

def user_lengths(stream, systems) -> list[int]:
    prev: dict[str, Item] = {}
    out = []
    for it in stream:
        if it.turn == 0:
            s = system_prefix(it, systems)
            out.append(len(it.prompt) - (len(s) if s else 0))
        else:
            p = prev[it.conversation]
            out.append(len(it.prompt) - len(p.prompt) - len(p.output))
        prev[it.conversation] = it
    return out


def test_lengths_within_bounds(stream, systems):
    spec = SyntheticSpec()
    assert all(len(it.prompt) + len(it.output) <= spec.max_len for it in stream)
    assert all(spec.output_len[0] <= len(it.output) <= spec.output_len[1] for it in stream)
    users = user_lengths(stream, systems)
    assert min(users) >= spec.user_len[0] and max(users) <= spec.user_len[1]
    assert all(it.turn < spec.max_turns for it in stream)


def test_lengths_have_roughly_the_intended_medians(stream, systems):
    out_median = statistics.median(len(it.output) for it in stream)
    assert 12 <= out_median <= 21, out_median          # ~16
    user_median = statistics.median(user_lengths(stream, systems))
    assert 90 <= user_median <= 160, user_median       # ~120


def test_turns_per_conversation_mean():
    spec = SyntheticSpec(seed=5)
    items = take(3000, spec)
    turns: dict[str, int] = {}
    for it in items:
        turns[it.conversation] = it.turn + 1
    # conversations still open at the end of the sample are cut short: drop them
    last = len(turns) - 3 * spec.open_conversations
    finished = [n for c, n in turns.items() if int(c[1:]) < last]
    mean = statistics.mean(finished)
    assert 2.0 <= mean <= 2.9, mean                    # geometric mean 2.5, capped at 8
    assert max(finished) <= spec.max_turns


def test_small_max_len_ends_conversations_early():
    spec = SyntheticSpec(max_len=1400, system_len=(300, 400), user_len=(16, 500),
                         output_len=(8, 300), mean_turns=6)
    items = take(N, spec)
    assert all(len(it.prompt) + len(it.output) <= 1400 for it in items)
    assert max(it.turn for it in items) >= 2


@pytest.mark.parametrize("change, message", [
    (dict(max_len=2000), "max_len 2000 is below the longest first turn, 4536 tokens"),
    (dict(share_system=1.5), r"share_system must be in \[0, 1\], got 1.5"),
    (dict(user_len=(100, 10)), r"user_len must be ints \(1 <= min <= max\), got \(100, 10\)"),
    (dict(num_system_prompts=0), "share_system=0.8 needs system prompts"),
    (dict(max_turns=0), "max_turns must be >= 1, got 0"),
    (dict(vocab=0), "vocab must be >= 1, got 0"),
])
def test_bad_spec_raises_at_call(change, message):
    with pytest.raises(ValueError, match=message):
        synthetic(SyntheticSpec(**change))


def test_no_system_prompts_at_all():
    items = take(200, SyntheticSpec(num_system_prompts=0, share_system=0.0))
    firsts = [it.prompt[:16] for it in items if it.turn == 0]
    assert len(set(firsts)) == len(firsts)   # nothing shared between conversations


# -- assign -----------------------------------------------------------------

@pytest.mark.parametrize("how", ["round-robin", "hash"])
@pytest.mark.parametrize("num_workers", [1, 2, 3, 4])
def test_assign_partitions_the_stream(stream, how, num_workers):
    shares = [list(assign(iter(stream), w, num_workers, how)) for w in range(num_workers)]
    rids = [it.rid for share in shares for it in share]
    assert len(rids) == len(set(rids)) == len(stream)       # no overlap, nothing lost
    assert set(rids) == {it.rid for it in stream}
    index = {it.rid: i for i, it in enumerate(stream)}
    for share in shares:                                     # stream order kept
        positions = [index[it.rid] for it in share]
        assert positions == sorted(positions)
    if num_workers > 1:
        assert all(shares)


def test_round_robin_takes_every_nth(stream):
    assert [it.rid for it in assign(stream, 1, 3)] == [it.rid for it in stream[1::3]]


@pytest.mark.parametrize("how", ["round-robin", "hash"])
def test_assign_names_the_worker_of_each_previous_turn(stream, how):
    """key: the conversation's number by first appearance (the same in every
    worker's share); after: the worker that serves the turn before."""
    served = {}
    for w in range(3):
        for it in assign(stream, w, 3, how):
            served[it.rid] = (w, it)
    keys = {}
    for it in stream:
        keys.setdefault(it.conversation, len(keys))
    for rid, (w, it) in served.items():
        assert it.key == keys[it.conversation]
        if it.turn == 0:
            assert it.after == -1
        else:
            prev_w, _ = served[f"{it.conversation}-t{it.turn - 1}"]
            assert it.after == prev_w
            if how == "hash":
                assert prev_w == w
    assert any(it.after not in (-1, w) for w, it in served.values()) == (how == "round-robin")


def test_hash_keeps_conversations_together(stream):
    owner: dict[str, int] = {}
    for w in range(3):
        for it in assign(stream, w, 3, how="hash"):
            assert owner.setdefault(it.conversation, w) == w
    assert set(owner.values()) == {0, 1, 2}


def test_assign_is_lazy_on_an_infinite_stream():
    first = list(itertools.islice(assign(synthetic(), 2, 4, "hash"), 50))
    assert len(first) == 50


@pytest.mark.parametrize("args, message", [
    ((0, 2, "random"), r"how must be one of \('round-robin', 'hash'\), got 'random'"),
    ((2, 2), r"worker must be in \[0, 2\), got 2"),
    ((-1, 2), r"worker must be in \[0, 2\), got -1"),
    ((0, 0), "num_workers must be an int >= 1, got 0"),
])
def test_assign_rejects_bad_arguments_at_call(args, message):
    with pytest.raises(ValueError, match=message):
        assign([], *args)


# -- load_jsonl -------------------------------------------------------------

def write(tmp_path: Path, *lines: str) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_tokenize_is_stable_and_in_vocab():
    a = tokenize("Hello world  hello\tworld\n", 1000)
    assert len(a) == 4 and a[1] == a[3] and a[0] != a[2]   # case matters, spacing does not
    assert all(0 <= t < 1000 for t in a)
    assert tokenize("", 1000) == ()
    with pytest.raises(ValueError, match="vocab must be >= 1, got 0"):
        tokenize("x", 0)


def test_load_ids_and_text(tmp_path):
    p = write(tmp_path,
              json.dumps({"prompt_ids": [1, 2, 3], "output_ids": [4, 5], "id": "a"}),
              "",
              "   ",
              json.dumps({"prompt": "you are a helpful assistant", "output_len": 3}),
              json.dumps({"prompt_ids": [1, 2, 3, 4, 5, 6], "conversation": "a"}))
    items = load_jsonl(p, default_output_len=7)
    assert [it.rid for it in items] == ["a", "l4", "l5"]
    a, text, follow = items
    assert a == Item("a", (1, 2, 3), (4, 5), "a", 0)
    assert text.prompt == tokenize("you are a helpful assistant", 32000)
    assert len(text.output) == 3 and all(0 <= t < 32000 for t in text.output)
    assert (text.conversation, text.turn) == ("l4", 0)
    assert len(follow.output) == 7
    assert (follow.conversation, follow.turn) == ("a", 1)
    assert load_jsonl(p, default_output_len=7) == items     # generated outputs are stable


@pytest.mark.parametrize("line, message", [
    ('{"prompt_ids": [1, 2', "invalid JSON"),
    ('[1, 2, 3]', "expected a JSON object, got list"),
    ('{"output_len": 3}', r"no prompt \(need 'prompt_ids' or 'prompt'\)"),
    ('{"prompt_ids": [1, "2"]}', r"prompt_ids\[1\] is '2', not an int token id"),
    ('{"prompt_ids": [1, 2.5]}', r"prompt_ids\[1\] is 2.5, not an int token id"),
    ('{"prompt_ids": [1, true]}', r"prompt_ids\[1\] is True, not an int token id"),
    ('{"prompt_ids": "1 2"}', "'prompt_ids' must be a list of token ids, got str"),
    ('{"prompt_ids": [1, -2]}', r"prompt_ids\[1\] is -2, a negative token id"),
    ('{"prompt_ids": [1], "output_ids": [-1]}', r"output_ids\[0\] is -1, a negative token id"),
    ('{"prompt_ids": []}', "empty prompt"),
    ('{"prompt": "   "}', "empty prompt"),
    ('{"prompt": 5}', "'prompt' must be a string, got int"),
    ('{"prompt": "a", "prompt_ids": [1]}', "either 'prompt_ids' or 'prompt', not both"),
    ('{"prompt_ids": [1], "output_len": -1}', "'output_len' must be an int >= 0, got -1"),
    ('{"prompt_ids": [1], "output_ids": [1], "output_len": 1}', "not both"),
    ('{"prompt_ids": [1], "id": 7}', "'id' must be a non-empty string, got 7"),
    ('{"prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "output_len": 2}',
     r"prompt \(9\) \+ output \(2\) = 11 tokens, over max_len 10"),
])
def test_load_errors_name_file_and_line(tmp_path, line, message):
    p = write(tmp_path, '{"prompt_ids": [1], "output_len": 1}', "", line)
    with pytest.raises(ValueError, match=message) as e:
        load_jsonl(p, max_len=10)
    assert str(e.value).startswith(f"{p}:3: ")


def test_load_duplicate_id(tmp_path):
    p = write(tmp_path, '{"prompt_ids": [1], "id": "x"}', '{"prompt_ids": [2], "id": "x"}')
    with pytest.raises(ValueError, match=rf"{p}:2: duplicate id 'x' \(first on line 1\)"):
        load_jsonl(p)


def test_load_bad_arguments_and_missing_file(tmp_path):
    p = write(tmp_path, '{"prompt_ids": [1]}')
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        load_jsonl(p, max_len=0)
    with pytest.raises(ValueError, match="default_output_len must be >= 0, got -1"):
        load_jsonl(p, default_output_len=-1)
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "nope.jsonl")


def test_fit_scales_lengths_to_a_short_model():
    spec = SyntheticSpec().fit(2048).validate()
    assert spec.max_len == 2048
    assert spec.system_len[1] + spec.user_len[1] + spec.output_len[1] <= 2048
    items = take(300, spec)
    assert all(len(it.prompt) + len(it.output) <= 2048 for it in items)
    roomy = SyntheticSpec().fit(8192)
    assert (roomy.system_len, roomy.user_len, roomy.output_len, roomy.max_len) == (
        SyntheticSpec().system_len, SyntheticSpec().user_len, SyntheticSpec().output_len, 8192)
    with pytest.raises(ValueError, match="max_len 10 is too short"):
        SyntheticSpec().fit(10)


# -- RAG and unique workloads ---------------------------------------------------------------------
def test_rag_requests_share_their_document_in_a_row():
    items = list(rag(RagSpec(num_docs=3, questions=4, doc_len=(50, 60), question_len=(5, 9))))
    assert [it.rid for it in items[:5]] == ["d0-q0", "d0-q1", "d0-q2", "d0-q3", "d1-q0"]
    for d in range(3):
        group = items[4 * d:4 * d + 4]
        doc_len = len(os.path.commonprefix([it.prompt for it in group]))
        assert 50 <= doc_len and all(5 <= len(it.prompt) - doc_len <= 9 + 1 for it in group)
    assert items == list(rag(RagSpec(num_docs=3, questions=4, doc_len=(50, 60),
                                     question_len=(5, 9))))       # deterministic
    assert all(len(it.output) == 16 and it.turn == 0 for it in items)


def test_unique_prompts_share_nothing_and_distinct_tokens_counts_the_trie():
    spec = RagSpec(num_docs=2, questions=3, doc_len=(40, 40), question_len=(4, 4), output_len=3)
    unique = list(rag(dataclasses.replace(spec, shared=False)))
    assert distinct_tokens(unique) == sum(len(it.prompt) + 2 for it in unique)
    shared = list(rag(spec))
    # Per document: its 40 tokens once, then each question's 4 and 2 output tokens.
    assert distinct_tokens(shared) == 2 * (40 + 3 * (4 + 2))
    a = Item("a", (1, 2, 3), (9,), "a", 0)
    assert distinct_tokens([a, Item("b", (1, 2, 4), (8, 7), "b", 0)]) == 3 + 2


def test_the_rag_and_unique_files_in_the_tests_data_are_the_generators():
    """tests/data/workloads/*.jsonl: `write_jsonl(rag(RagSpec(...)))`,
    read back as the same items."""
    for name, spec in (("rag", RagSpec()), ("unique", RagSpec(shared=False))):
        assert load_jsonl(DATA / "workloads" / f"{name}.jsonl") == list(rag(spec)), name


def test_bad_rag_specs_are_refused():
    for bad in (dict(num_docs=0), dict(questions=True), dict(doc_len=(5, 4)),
                dict(question_len=(0, 3)), dict(output_len=-1), dict(vocab=0)):
        with pytest.raises(ValueError):
            rag(RagSpec(**bad))


def test_write_jsonl_round_trips(tmp_path):
    items = list(rag(RagSpec(num_docs=1, questions=2, doc_len=(5, 5), question_len=(2, 2))))
    assert write_jsonl(items, tmp_path / "w.jsonl") == 2
    assert load_jsonl(tmp_path / "w.jsonl") == items


# -- the vLLM driver's and bench_vllm's shapes ---------------------------------------------
def test_conversations_carry_each_answer_into_the_next_turn():
    items = list(conversations(3, 4, 2, 50, seed=1))
    assert [it.rid for it in items[:5]] == ["c0-t0", "c0-t1", "c0-t2", "c0-t3", "c1-t0"]
    for a, b in zip(items, items[1:]):
        if a.conversation == b.conversation:
            assert b.prompt[:len(a.prompt) + len(a.output)] == a.prompt + a.output
            assert 64 <= len(b.prompt) - len(a.prompt) - len(a.output) < 160
            assert 32 <= len(a.output) < 96
    assert min(t for it in items for t in it.prompt) >= 3
    assert items == list(conversations(3, 4, 2, 50, seed=1))
    assert items != list(conversations(3, 4, 2, 50, seed=2))


def test_poisson_arrivals_are_seeded_open_loop_times():
    times = poisson_arrivals(4000, 8.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert times == poisson_arrivals(4000, 8.0, seed=3) != poisson_arrivals(4000, 8.0, seed=4)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert 0.95 / 8 < statistics.mean(gaps) < 1.05 / 8          # 4,000 draws: within 5 %
    assert 0.9 / 8 < statistics.stdev(gaps) < 1.1 / 8           # exponential: sd = mean
    assert poisson_arrivals(0, 1.0) == [] and poisson_arrivals(1, 1.0) == [0.0]
    for n, rate in ((-1, 1.0), (3, 0.0), (3, -2.0), (3, float("nan")), (3, float("inf"))):
        with pytest.raises(ValueError, match="need n >= 0 and a finite rate > 0"):
            poisson_arrivals(n, rate)


def test_shared_prefix_has_shared_prompts_and_exact_duplicates():
    items = shared_prefix(seed=5, num_requests=6, prefix_lens=(40, 30))
    assert [it.rid for it in items] == ["r0", "r1", "r2", "r3", "r4", "r5", "dup0", "dup3"]
    assert items[6].prompt == items[0].prompt and len(items[6].output) == 12
    assert items[7].prompt == items[3].prompt and len(items[7].output) == 30
    assert items[0].prompt[:40] == items[2].prompt[:40] != items[1].prompt[:40]
    assert all(8 <= len(it.output) < 40 for it in items[:6])
    with pytest.raises(ValueError, match="num_requests must be >= 4, got 3"):
        shared_prefix(num_requests=3)
