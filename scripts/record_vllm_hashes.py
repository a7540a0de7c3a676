#!/usr/bin/env python3
"""Record block hashes computed by the installed vLLM's own code (0.14.0 or
0.32.0) for requests with multimodal features, prompt embeds, LoRA names
and cache salts, as test vectors for kvshm's `vllm-sha256` and
`vllm-sha256-cbor` hashing (on a pool of that release's semantics: 0.32
tags its extra keys and hashes the LoRA's path).

    .venv-vllm/bin/python scripts/record_vllm_hashes.py OUT.json [--seed 0] [--random 40]
    .venv-vllm-0.32.0/bin/python scripts/record_vllm_hashes.py OUT.json

Runs in a vLLM environment (./scripts/vllm_env.sh [VERSION]).  Each case is a
request as vLLM's scheduler sees it: a prompt (token ids, or prompt embeds
with vLLM's zero placeholder ids), its multimodal placeholders (offset,
length, item hash), then tokens appended step by step; vLLM's request block
hasher runs at construction and after every append, as in an engine, and
the case records every block hash it produced.  The hand-written cases pin
the edges of vLLM's placeholder walk (a block starting where an item ends,
an item ending on a block boundary, blocks completed later by generated
tokens, token ids vLLM takes that kvshm's own hashing does not: -1 image
placeholders, as vLLM's own multimodal prefix-caching test writes them, and
ids across the 64-bit range); `--random N` adds N random cases drawn with
`--seed`.

tests/data/vllm_mm_block_hashes.json (0.14.0) and
tests/data/conformance-0.32.0/vllm_mm_block_hashes.json (0.32.0) were
written by this script (seed 0); tests/test_vllm.py also runs it with a
fresh seed on each release and compares kvshm's hashes to vLLM's on the
spot.  Each case names its release (`vllm_version`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

ALGORITHMS = {"vllm-sha256": "sha256", "vllm-sha256-cbor": "sha256_cbor"}


def hand_cases() -> list[dict]:
    """Cases chosen for the edges of vLLM's walk (block size 4 unless said)."""
    def case(name, prompt_len, mm=(), appends=(), bs=4, lora=None, salt=None, embeds=None,
             ids=None):
        return {"name": name, "block_size": bs, "prompt_len": prompt_len,
                "mm_features": [list(f) for f in mm], "appends": [list(a) for a in appends],
                "lora_name": lora, "cache_salt": salt, "embeds": embeds, "ids": ids}
    steps = [[7], [8], [9], [10, 11, 12, 13, 14, 15]]
    return [
        case("items in, across and on block edges", 20,
             [(2, 3, "img-a"), (5, 2, "img-b"), (8, 4, "img-c")], steps),
        case("item ending on the last full prompt block, completed later", 10,
             [(4, 4, "img")], [[1], [2], [3, 4, 5, 6, 7]]),
        case("an item ending where a later pass starts, then the last item", 10,
             [(4, 4, "a"), (8, 1, "b")], [[1], [2], [3, 4, 5, 6]]),
        case("two items past the last full prompt block", 10, [(8, 1, "a"), (9, 1, "b")],
             [[1], [2, 3]]),
        case("prompt shorter than a block", 10, [(0, 4, "x"), (4, 4, "y")],
             [[1]] * 10, bs=16),
        case("one item over many blocks", 40, [(3, 30, "big")], [[5] * 9], bs=8),
        case("lora, items and salt together", 24, [(0, 6, "m0"), (12, 9, "m1")],
             steps, lora="adapter-a", salt="tenant-salt"),
        case("item at the very end of the prompt", 12, [(9, 3, "tail")], steps),
        case("adjacent items filling blocks", 16, [(0, 4, "p"), (4, 4, "q"), (8, 8, "r")],
             steps),
        case("prompt embeds, float32", 18, appends=steps,
             embeds={"dtype": "float32", "hidden": 4}),
        case("prompt embeds, bfloat16, with lora and salt", 13, appends=steps,
             lora="adapter-b", salt="s", embeds={"dtype": "bfloat16", "hidden": 3}),
        case("prompt embeds and items", 21, [(4, 5, "e-img")], steps,
             embeds={"dtype": "float16", "hidden": 2}),
        case("image placeholder ids -1, as vLLM's multimodal test", 20,
             [(2, 7, "img-a"), (12, 5, "img-b")], steps, ids="placeholder"),
        case("ids across the 64-bit range", 16, appends=[[-1], [2**63 - 1], [-2**63, 2**32]],
             ids="wide"),
    ]


# Edges of the encodings (CBOR's and pickle's integer forms) in 64 bits.
WIDE_IDS = (-1, -24, -25, -256, -257, -65537, -2**31, -2**31 - 1, -2**63, 2**32 - 1, 2**32,
            2**40, 2**63 - 1)


def draw_ids(rng: random.Random, n: int, ids: str | None, mm=()) -> list[int]:
    """`n` token ids: vocabulary ids; with "placeholder" -1 over the items'
    spans; with "wide" a mix of them and WIDE_IDS."""
    out = [rng.randrange(2**17) for _ in range(n)]
    if ids == "placeholder":
        for off, length, _ in mm:
            out[off:off + length] = [-1] * length
    elif ids == "wide":
        out = [rng.choice(WIDE_IDS) if rng.random() < 0.5 else t for t in out]
    return out


def random_cases(rng: random.Random, n: int) -> list[dict]:
    out = []
    for i in range(n):
        bs = rng.choice((1, 2, 4, 16))
        prompt_len = rng.randint(1, 6 * bs + 3)
        mm, pos = [], rng.randint(0, 3)
        while pos < prompt_len and rng.random() < 0.7:
            length = rng.randint(1, min(prompt_len - pos, 3 * bs))
            mm.append([pos, length, f"item-{rng.randrange(3)}-{length}"])
            pos += length + rng.choice((0, 0, 1, bs))
        ids = rng.choice((None, None, "placeholder", "wide"))
        appends = [draw_ids(rng, rng.choice((1, 1, 1, 2, bs, 3 * bs)),
                            None if ids is None else "wide")
                   for _ in range(rng.randint(0, 8))]
        embeds = ({"dtype": rng.choice(("float32", "bfloat16")), "hidden": rng.randint(1, 4)}
                  if rng.random() < 0.25 else None)
        out.append({"name": f"random {i}", "block_size": bs, "prompt_len": prompt_len,
                    "mm_features": mm, "appends": appends,
                    "lora_name": rng.choice((None, None, "lora-x")),
                    "cache_salt": rng.choice((None, None, "salt-y")), "embeds": embeds,
                    "ids": ids})
    return out


def record(cases: list[dict], rng: random.Random) -> list[dict]:
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request
    from vllm.version import __version__

    release = __version__.split("+", 1)[0]
    out = []
    for algorithm, vllm_name in ALGORITHMS.items():
        for seed in ("0", "kvshm-oracle-0"):
            fn = get_hash_fn_by_name(vllm_name)
            os.environ["PYTHONHASHSEED"] = seed
            kv_cache_utils.init_none_hash(fn)
            for c in cases:
                c = dict(c, algorithm=algorithm, seed=seed, vllm_version=release,
                         lora_path="/adapters/" + c["lora_name"] if c["lora_name"] else None)
                n = c["prompt_len"]
                embeds = None
                if c["embeds"]:
                    dtype = getattr(torch, c["embeds"]["dtype"])
                    embeds = torch.tensor([[rng.uniform(-4, 4) for _ in range(c["embeds"]["hidden"])]
                                           for _ in range(n)], dtype=dtype)
                    c["prompt"] = None
                    c["prompt_embeds"] = kv_cache_utils.tensor_data(embeds).tobytes().hex()
                else:
                    c["prompt"] = draw_ids(rng, n, c["ids"], c["mm_features"])
                    c["prompt_embeds"] = None
                features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                                  mm_position=PlaceholderRange(off, length))
                            for off, length, ident in c["mm_features"]]
                lora = (LoRARequest(c["lora_name"], 1, c["lora_path"]) if c["lora_name"]
                        else None)
                hasher = kv_cache_utils.get_request_block_hasher(c["block_size"], fn)
                req = Request(f"r{len(out)}", c["prompt"], SamplingParams(max_tokens=1), None,
                              None, prompt_embeds=embeds, mm_features=features,
                              lora_request=lora, cache_salt=c["cache_salt"],
                              block_hasher=hasher)
                steps = [[h.hex() for h in req.block_hashes]]
                for tokens in c["appends"]:
                    before = len(req.block_hashes)
                    req.append_output_token_ids(tokens)
                    steps.append([h.hex() for h in req.block_hashes[before:]])
                c["none_hash"] = kv_cache_utils.NONE_HASH.hex()
                c["block_hashes"] = steps
                out.append(c)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random", type=int, default=40, metavar="N")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    cases = hand_cases() + random_cases(rng, args.random)
    from vllm.version import __version__
    vectors = {"source": f"vLLM {__version__} v1/core/kv_cache_utils.get_request_block_hasher "
                         "on v1/request.Request, recorded by scripts/record_vllm_hashes.py",
               "seed": args.seed, "cases": record(cases, rng)}
    with open(args.out, "w") as f:
        json.dump(vectors, f, indent=0)
        f.write("\n")
    print(f"{len(vectors['cases'])} cases written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
