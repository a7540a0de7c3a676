"""Multimodal items and prompt embeds as block-hash extra keys: vLLM's own
hashes, kvshm's, refusals that change nothing, the wire, and a restore after
a coordinator restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import make_config, replay_case, tokens
from kvshm import (
    BadMultimodalInput,
    BlockHasher,
    InvalidArgument,
    MultiModalFeature,
    Request,
    UnknownRequest,
)
from kvshm.core.events import BlockStored, external_hash
from kvshm.ops import protocol as p
from kvshm.ops.errors import ProtocolError
from kvshm.service.process import CoordinatorProcess
from kvshm.service.resume import Reconnect
from kvshm.service.sync_client import connect_sync

# Recorded by scripts/record_vllm_hashes.py (the release's request block
# hasher on its own Request, at construction and after every append):
# vLLM 0.14.0's, and 0.32.0's (tagged extra keys, the LoRA's path hashed).
DATA = Path(__file__).parent / "data"
VECTORS = json.loads((DATA / "vllm_mm_block_hashes.json").read_text())
VECTORS_032 = json.loads((DATA / "conformance-0.32.0" / "vllm_mm_block_hashes.json").read_text())


@pytest.mark.parametrize("case", VECTORS["cases"] + VECTORS_032["cases"],
                         ids=lambda c: f"{c.get('vllm_version', '0.14.0')}-{c['algorithm']}-"
                                       f"{c['seed']}-{c['name']}")
def test_vllm_algorithms_hash_items_and_embeds_as_vllm_does(case):
    assert BlockHasher(case["algorithm"], case["seed"], 1).none_hash.hex() == case["none_hash"]
    assert replay_case(case) == case["block_hashes"]


def test_a_0_32_pool_hashes_a_lora_with_its_path():
    """vLLM 0.32 hashes the adapter's path: a LoRA request without one is
    refused on a pool of its semantics (not on 0.14's, nor with kvshm's
    own hashing), and two paths give two chains."""
    from kvshm.pool.kv_cache_manager import KVCacheManager
    from helpers import make_config
    for release, refused in (("0.32.0", True), ("0.14.0", False)):
        with KVCacheManager(make_config(vllm_version=release, hash_algorithm="vllm-sha256",
                                        hash_seed="0")) as m:
            h = m.make_hasher()
            assert h.tagged is refused
            if refused:
                with pytest.raises(InvalidArgument, match="LoRA 'ad' needs its lora_path"):
                    Request("r", tokens(0, 8), h, lora_name="ad")
                a = Request("a", tokens(0, 8), h, lora_name="ad", lora_path="/x").block_hashes
                b = Request("b", tokens(0, 8), h, lora_name="ad", lora_path="/y").block_hashes
                assert a != b
            else:
                Request("r", tokens(0, 8), h, lora_name="ad")
    Request("r", tokens(0, 8), BlockHasher("sha256", "s", 4, tagged=True), lora_name="ad")


def test_the_vectors_cover_the_walk_s_edges():
    names = {c["name"] for c in VECTORS["cases"]}
    assert {"an item ending where a later pass starts, then the last item",
            "prompt embeds, bfloat16, with lora and salt",
            "image placeholder ids -1, as vLLM's multimodal test",
            "ids across the 64-bit range"} <= names
    assert {c["algorithm"] for c in VECTORS["cases"]} == {"vllm-sha256", "vllm-sha256-cbor"}


# -- kvshm's own hashing ---------------------------------------------------------------
H = BlockHasher("sha256", "s", 4)


def own(mm=None, embeds=None, prompt=None, **kw):
    return Request("r", tokens(0, 12) if prompt is None else prompt, H, mm_features=mm,
                   prompt_embeds=embeds, **kw).block_hashes


def test_an_item_changes_the_blocks_it_overlaps_and_the_chain_after():
    plain = own()
    a = own([(4, 3, "img-a")])
    b = own([(4, 3, "img-b")])
    assert a[0] == plain[0] and a[1] != plain[1] and a[2] != plain[2]
    assert a[1] != b[1]
    assert own([(4, 3, "img-a")], lora_name="l") != own(lora_name="l")


def test_placement_matters_even_where_vllm_s_keys_would_not_tell():
    """Same tokens, same items, another split between them: vLLM's keys
    (identifiers only) are equal; kvshm's own name offsets and lengths."""
    ph = [9] * 8
    one = own([(0, 5, "a"), (5, 3, "b")], prompt=ph)
    two = own([(0, 3, "a"), (3, 5, "b")], prompt=ph)
    assert one[1] != two[1]
    v = BlockHasher("vllm-sha256", "0", 8)
    assert (Request("x", ph, v, mm_features=[(0, 5, "a"), (5, 3, "b")]).block_hashes
            == Request("y", ph, v, mm_features=[(0, 3, "a"), (3, 5, "b")]).block_hashes)


def test_items_are_kept_sorted_and_named_by_their_fields():
    r = Request("r", tokens(0, 12), H, mm_features=[(8, 2, "b"), MultiModalFeature(1, 3, "a")])
    assert r.mm_features == (MultiModalFeature(1, 3, "a"), MultiModalFeature(8, 2, "b"))
    assert r.block_hashes == own([(1, 3, "a"), (8, 2, "b")])


def test_prompt_embeds_hash_their_rows_and_blocks_past_the_prompt():
    rows = bytes(range(40))                     # 10 rows of 4 bytes
    r = Request("r", None, H, prompt_embeds=memoryview(rows).cast("B", (10, 4)))
    assert r.all_token_ids == [0] * 10 and r.prompt_embeds == rows
    assert r.block_hashes == own(embeds=rows, prompt=[0] * 10)
    other = bytearray(rows)
    other[39] ^= 1                              # last row: block 2, not yet full
    assert own(embeds=bytes(other), prompt=[0] * 10) == r.block_hashes
    other[0] ^= 1
    assert own(embeds=bytes(other), prompt=[0] * 10)[0] != r.block_hashes[0]
    assert r.block_hashes[0] != own(prompt=[0] * 10)[0]
    r.append_token_ids([0, 0, 0, 0, 0, 0])      # block 2 straddles the end, block 3 is past it
    s = Request("s", [0] * 10, H)
    s.append_token_ids([0] * 6)
    assert r.block_hashes[3] != s.block_hashes[3]   # past the prompt: empty rows, still a key


def test_requests_without_items_or_embeds_hash_as_before():
    """Pools outlive coordinators: the encoding of old requests is pinned
    (the values kvshm gave before items and embeds existed)."""
    r = Request("r", tokens(0, 8), H, lora_name="l", cache_salt="s")
    assert [h.hex()[:16] for h in r.block_hashes] == ["2a7c98486964c92c", "c4e9495e215ce156"]


BAD_ITEMS = [
    ([(0, 5, "a"), (4, 2, "b")], "overlap"),
    ([(10, 3, "a")], "outside the prompt of 12 tokens"),
    ([(-1, 3, "a")], "offset must be an integer >= 0"),
    ([(0, 0, "a")], "length one >= 1"),
    ([(True, 2, "a")], "offset must be"),
    ([(0, 2, 7)], "identifier must be a non-empty string.*int 7"),
    ([(0, 2, b"h")], "identifier must be a non-empty string.*bytes"),
    ([(0, 2, "")], "identifier must be a non-empty string"),
    ([(0, 2)], r"mm_features\[0\] must be \(offset, length, identifier\)"),
    ("abc", "must be a list"),
]


@pytest.mark.parametrize("items, message", BAD_ITEMS)
def test_bad_items_are_refused(items, message):
    with pytest.raises(BadMultimodalInput, match=message):
        Request("r", tokens(0, 12), H, mm_features=items)


@pytest.mark.parametrize("embeds, prompt, message", [
    (object(), None, "buffer protocol"),
    (bytes(12), None, "flat bytes need the prompt's token count"),
    (bytes(13), tokens(0, 4), "13 bytes do not split into 4 equal rows"),
    (memoryview(bytes(12)).cast("B", (3, 4)), tokens(0, 4), "3 rows for a prompt of 4"),
    (b"", [], "do not split into 0"),
])
def test_bad_embeds_are_refused(embeds, prompt, message):
    with pytest.raises(BadMultimodalInput, match=message):
        Request("r", prompt, H, prompt_embeds=embeds)


def test_a_request_needs_tokens_or_embeds():
    with pytest.raises(InvalidArgument, match="prompt_token_ids or prompt_embeds"):
        Request("r", None, H)


# -- over the wire ---------------------------------------------------------------------
def vllm_case(name: str, algorithm: str) -> dict:
    [case] = [c for c in VECTORS["cases"] if c["name"] == name and c["seed"] == "0"
              and c["algorithm"] == algorithm]
    return case


@pytest.fixture
def vllm_proc(pool_name):
    cfg = make_config(num_blocks=64, max_num_seqs=16, hash_algorithm="vllm-sha256",
                      hash_seed="0")
    with CoordinatorProcess(cfg, name=pool_name) as proc:
        yield proc


def sync_client(proc):
    return connect_sync(proc.socket, hash_algorithm="vllm-sha256", hash_seed="0",
                        reconnect=Reconnect(initial_delay=0.01, max_delay=0.1, timeout=20.0))


def stored_hashes(events) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


@pytest.mark.parametrize("name", ["lora, items and salt together",
                                  "prompt embeds, bfloat16, with lora and salt",
                                  "prompt embeds and items"])
def test_the_coordinator_stores_vllm_s_hashes_for_items_and_embeds(vllm_proc, name):
    case = vllm_case(name, "vllm-sha256")
    embeds = bytes.fromhex(case["prompt_embeds"]) if case["prompt_embeds"] else None
    with sync_client(vllm_proc) as c:
        assert c.take_events() == []
        c.add_request("r", case["prompt"], lora_name=case["lora_name"],
                      cache_salt=case["cache_salt"], mm_features=case["mm_features"],
                      prompt_embeds=embeds, num_tokens=case["prompt_len"])
        c.allocate_slots("r", case["prompt_len"])
        c.cache_blocks("r", case["prompt_len"])
        want = [external_hash(bytes.fromhex(h)) for h in case["block_hashes"][0]]
        assert stored_hashes(c.take_events()) == want


def test_image_placeholder_ids_are_hashed_and_published_as_vllm_does(vllm_proc):
    """-1 where an image goes (vLLM's own multimodal prefix-caching test):
    the coordinator hashes it as vLLM does and its events carry the ids."""
    case = vllm_case("image placeholder ids -1, as vLLM's multimodal test", "vllm-sha256")
    assert case["prompt"].count(-1) == 12
    with sync_client(vllm_proc) as c:
        c.take_events()
        c.add_request("r", case["prompt"], mm_features=case["mm_features"])
        c.allocate_slots("r", 20)
        c.cache_blocks("r", 20)
        events = [e for e in c.take_events() if isinstance(e, BlockStored)]
        want = [external_hash(bytes.fromhex(h)) for h in case["block_hashes"][0]]
        assert [h for e in events for h in e.block_hashes] == want
        assert [t for e in events for t in e.token_ids] == case["prompt"]


def test_a_kvshm_hashed_pool_refuses_negative_ids_saying_why_and_changes_nothing(pool_name):
    with CoordinatorProcess(make_config(num_blocks=64, max_num_seqs=16), name=pool_name) as proc:
        with connect_sync(proc.socket) as c:
            for call in (lambda: c.add_request("a", [5, -1, 6]),
                         lambda: c.call(p.AddRequest("a", [5, -1, 6]))):
                with pytest.raises(InvalidArgument, match="pack each id in 4 bytes; a pool "
                                                          "hashing with vllm-sha256"):
                    call()
            with pytest.raises(UnknownRequest):
                c.get_block_ids("a")
            c.add_request("a", [5, 0, 6])                  # the id is still free
            assert c.get_block_ids("a") == [[]]


def test_bad_items_over_the_wire_are_refused_and_change_nothing(vllm_proc):
    with sync_client(vllm_proc) as c:
        # Checked by the client before sending...
        with pytest.raises(BadMultimodalInput, match="overlap"):
            c.add_request("a", tokens(0, 12), mm_features=[(0, 5, "x"), (4, 2, "y")])
        # ...and by the coordinator, whatever a client sends.
        with pytest.raises(BadMultimodalInput, match="outside the prompt"):
            c.call(p.AddRequest("a", tokens(0, 12), mm_features=[MultiModalFeature(11, 2, "x")]))
        with pytest.raises(ProtocolError, match="Expected `str`, got `int`"):
            c.call(p.AddRequest("a", tokens(0, 12), mm_features=[(0, 2, 5)]))
        with pytest.raises(BadMultimodalInput, match="do not split"):
            c.call(p.AddRequest("a", tokens(0, 4), prompt_embeds=bytes(7)))
        with pytest.raises(InvalidArgument, match="not both"):
            c.add_request("a", block_hashes=[], num_tokens=2, mm_features=[(0, 1, "x")])
        with pytest.raises(InvalidArgument, match="num_prompt_tokens must be in 0..12"):
            c.call(p.AddRequest("a", tokens(0, 12), num_prompt_tokens=13))
        with pytest.raises(UnknownRequest):
            c.get_block_ids("a")
        c.add_request("a", tokens(0, 12), mm_features=[(0, 5, "x")])   # the id is still free
        assert c.get_block_ids("a") == [[]]


def test_a_restored_request_hashes_its_blocks_in_the_passes_they_were_hashed(vllm_proc):
    """The block completed by generated tokens names the item that ends
    where it starts only because a later pass hashed it (vLLM's walk);
    hashing the whole token list in one pass would not, and the restored
    request would not match its cached block."""
    case = vllm_case("item ending on the last full prompt block, completed later",
                     "vllm-sha256")
    steps = [[external_hash(bytes.fromhex(h)) for h in step] for step in case["block_hashes"]]
    with sync_client(vllm_proc) as c:
        c.take_events()
        c.add_request("run", case["prompt"], mm_features=case["mm_features"])
        c.allocate_slots("run", 10)
        c.advance("run", 10, [1, 2])       # block 2 (tokens 8..11) complete: a later pass
        c.allocate_slots("run", 2)
        c.advance("run", 12, [3])
        c.cache_blocks("run", 12)
        assert stored_hashes(c.take_events()) == steps[0] + steps[2]
        held = c.get_block_ids("run")
        vllm_proc.kill()
        vllm_proc.restart()
        assert c.get_block_ids("run") == held and c.resumed_requests == 1
        c.take_events()
        c.allocate_slots("run", 1)
        c.advance("run", 13, [4, 5, 6])    # block 3 complete
        c.allocate_slots("run", 3)
        c.cache_blocks("run", 16)
        assert stored_hashes(c.take_events()) == steps[3]
