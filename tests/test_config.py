"""PoolConfig: validation rules (each naming its field), loading from TOML,
JSON and conformance-trace config lines, and the canonical JSON encoding."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from kvshm import (ChunkedLocalSpec, ConfigError, CrossAttentionSpec, FullSpec,
    KVCacheManager, MambaSpec, MLASpec, PoolConfig, SinkFullSpec, SlidingWindowSpec)

TRACES = Path(__file__).parent / "data" / "conformance" / "traces"

BASE = dict(num_blocks=10, hash_block_size=4, max_model_len=64, groups=(FullSpec(4),))

BASE_DICT = {
    "num_blocks": 10,
    "hash_block_size": 4,
    "max_model_len": 64,
    "groups": [{"type": "full", "block_size": 4}],
}


def config(**changes) -> PoolConfig:
    return PoolConfig(**{**BASE, **changes})


def field_of(changes: dict) -> str:
    with pytest.raises(ConfigError) as e:
        config(**changes)
    assert str(e.value).startswith(e.value.field + ": ")
    return e.value.field


# -- validation rules --------------------------------------------------------------


def test_the_base_config_is_valid():
    cfg = config()
    assert cfg.num_blocks == 10
    assert cfg.enable_caching is True
    assert cfg.max_num_seqs == 1024
    assert cfg.encoder_len == 64
    assert cfg.num_sink_blocks == 0


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(num_blocks=0), "num_blocks"),
        (dict(num_blocks=-5), "num_blocks"),
        (dict(num_blocks=1), "num_blocks"),
        (dict(num_blocks=2**31 - 1), "num_blocks"),     # ids are int32
        (dict(hash_block_size=0), "hash_block_size"),
        (dict(hash_block_size=-4), "hash_block_size"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=-1), "max_model_len"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_encoder_len=0), "max_encoder_len"),
        (dict(dcp_world_size=3), "dcp_world_size"),
        (dict(dcp_world_size=0), "dcp_world_size"),
        (dict(hash_algorithm="md5"), "hash_algorithm"),
        (dict(groups=()), "groups"),
        (dict(groups=(FullSpec(0),)), "groups[0].block_size"),
        (dict(groups=(FullSpec(-4),)), "groups[0].block_size"),
        (dict(groups=(FullSpec(4), SlidingWindowSpec(4, 0))), "groups[1].sliding_window"),
        (dict(groups=(FullSpec(4), SlidingWindowSpec(4, -8))), "groups[1].sliding_window"),
        (dict(groups=(FullSpec(4), ChunkedLocalSpec(4, 0))), "groups[1].attention_chunk_size"),
        (dict(groups=(SinkFullSpec(4, 0),)), "groups[0].sink_len"),
        (dict(groups=(SinkFullSpec(4, 6),)), "groups[0].sink_len"),
        (dict(groups=(FullSpec(4), MambaSpec(4, -1))), "groups[1].num_speculative_blocks"),
    ],
)
def test_non_positive_and_out_of_domain_values_name_their_field(changes, field):
    """Every broken rule raises ConfigError whose .field names the culprit."""
    assert field_of(changes) == field


def test_sink_len_must_be_a_multiple_of_the_dcp_scaled_block_size():
    """With dcp 2 a 4-token block is 8 tokens: sink_len 4 is not a multiple."""
    assert field_of(dict(groups=(SinkFullSpec(4, 4),), hash_block_size=8,
                         dcp_world_size=2)) == "groups[0].sink_len"
    cfg = config(groups=(SinkFullSpec(4, 16),), hash_block_size=8, dcp_world_size=2)
    assert cfg.num_sink_blocks == 2


def test_sink_blocks_must_leave_room_in_the_pool():
    """num_blocks must exceed the null block plus every sink block."""
    assert field_of(dict(num_blocks=3, groups=(SinkFullSpec(4, 8),))) == "num_blocks"
    assert config(num_blocks=4, groups=(SinkFullSpec(4, 8),)).num_sink_blocks == 2


def test_unitary_hash_block_size_must_equal_block_size_times_dcp():
    """One group with caching on: hash_block_size == block_size * dcp."""
    assert field_of(dict(groups=(FullSpec(8),))) == "hash_block_size"
    assert field_of(dict(dcp_world_size=2)) == "hash_block_size"
    config(hash_block_size=8, dcp_world_size=2)
    # Caching off: no hashes, no constraint.
    config(groups=(FullSpec(8),), enable_caching=False)


def test_hybrid_block_sizes_must_be_multiples_of_hash_block_size():
    assert field_of(dict(groups=(FullSpec(4), SlidingWindowSpec(6, 8)))) == "groups[1].block_size"
    assert field_of(dict(groups=(FullSpec(2), MLASpec(4)))) == "groups[0].block_size"
    config(groups=(FullSpec(4), SlidingWindowSpec(8, 16)))


def test_hybrid_needs_dcp_world_size_1():
    assert field_of(dict(groups=(FullSpec(4), MLASpec(4)), dcp_world_size=2)) == "dcp_world_size"


@pytest.mark.parametrize("spec", [SlidingWindowSpec(4, 8), ChunkedLocalSpec(4, 8), MambaSpec(4)])
def test_windowed_types_do_not_support_dcp(spec):
    assert field_of(dict(groups=(spec,), hash_block_size=8, dcp_world_size=2)) == "dcp_world_size"


def test_several_identical_groups_need_caching_off():
    """With caching on, identical groups alone make no hybrid model."""
    assert field_of(dict(groups=(FullSpec(4), FullSpec(4)))) == "groups"
    config(groups=(FullSpec(4), FullSpec(4)), enable_caching=False)
    # Identical groups next to a distinct spec are fine (looked up together).
    config(groups=(FullSpec(4), FullSpec(4), SlidingWindowSpec(4, 8)))


def test_cross_attention_needs_caching_off():
    assert field_of(dict(groups=(FullSpec(4), CrossAttentionSpec(4)))) == "groups[1].type"
    cfg = config(groups=(FullSpec(4), CrossAttentionSpec(4)), enable_caching=False,
                 max_encoder_len=100)
    assert cfg.encoder_len == 100


def test_eagle_is_not_supported_with_chunked_local_attention():
    assert field_of(dict(groups=(ChunkedLocalSpec(4, 8),), use_eagle=True)) == "use_eagle"


def test_eagle_windows_smaller_than_the_lcm_only_on_0_32_pools():
    """0.14's manager asserts that EAGLE and a hit aligned to more than the
    window's block do not go together; 0.32 runs them (its traces replay)."""
    groups = (FullSpec(8), SlidingWindowSpec(4, 16))
    assert field_of(dict(groups=groups, use_eagle=True)) == "groups[1].block_size"
    config(groups=groups, use_eagle=True, vllm_version="0.32.0")


def test_hybrid_chunked_local_block_size_must_be_the_lcm():
    assert field_of(dict(groups=(FullSpec(8), ChunkedLocalSpec(4, 16)))) == "groups[1].block_size"
    config(groups=(FullSpec(4), ChunkedLocalSpec(8, 16)))


@pytest.mark.parametrize(
    "changes",
    [dict(num_blocks="10"), dict(num_blocks=10.0), dict(enable_caching="no")],
    ids=["str-num_blocks", "float-num_blocks", "str-enable_caching"],
)
def test_validate_rejects_wrong_field_types_of_a_directly_built_config(changes):
    """BUG: validate() checks only values, not types.  A config built in code
    with num_blocks="10" makes validate() raise TypeError; num_blocks=10.0 and
    enable_caching="no" pass validation (the float then breaks segment
    creation, the string silently turns caching on).  Expected: ConfigError
    naming the field, as from_dict does."""
    field = next(iter(changes))
    with pytest.raises(ConfigError) as e:
        config(**changes)
    assert e.value.field == field


def test_every_way_of_making_a_config_checks_it():
    """No invalid PoolConfig exists: the constructor, replace() and decoding
    all raise ConfigError naming the field (decoding's rule errors are not
    wrapped in msgspec's ValidationError)."""
    for make in (lambda: config(num_blocks=1), lambda: config().replace(num_blocks=1),
                 lambda: PoolConfig.from_dict({**BASE_DICT, "num_blocks": 1}),
                 lambda: PoolConfig.from_json(config().to_json().replace(b'"num_blocks":10',
                                                                         b'"num_blocks":1'))):
        with pytest.raises(ConfigError, match="at least 2") as e:
            make()
        assert type(e.value) is ConfigError and e.value.field == "num_blocks"
    with pytest.raises(ConfigError) as e:
        config(groups=(FullSpec("4"),))
    assert e.value.field == "groups[0].block_size"


def test_a_manager_for_a_config_that_cannot_be_built_leaves_no_segment():
    """BUG: KVCacheManager(PoolConfig(num_blocks=10.0, ...)) passes validate(),
    then fails inside segment creation with a TypeError and leaves an empty
    /dev/shm segment behind (only OSError is cleaned up).  Expected:
    ConfigError and no segment."""
    name = f"kvshm-test-config-leak-{os.getpid()}"
    path = Path("/dev/shm") / name
    try:
        with pytest.raises(ConfigError):
            with KVCacheManager(config(num_blocks=10.0), name=name):
                pass
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)  # only the segment this test named


# -- from_dict ------------------------------------------------------------------------


def test_from_dict_builds_every_group_type():
    data = {
        **BASE_DICT,
        "num_blocks": 40,
        "hash_block_size": 4,
        "groups": [
            {"type": "full", "block_size": 4},
            {"type": "mla", "block_size": 4},
            {"type": "sliding_window", "block_size": 4, "sliding_window": 8},
            {"type": "chunked_local", "block_size": 4, "attention_chunk_size": 16},
            {"type": "sink_full", "block_size": 4, "sink_len": 8},
            {"type": "mamba", "block_size": 4, "num_speculative_blocks": 1},
            {"type": "mamba", "block_size": 4},
        ],
    }
    cfg = PoolConfig.from_dict(data)
    assert cfg.groups == (
        FullSpec(4), MLASpec(4), SlidingWindowSpec(4, 8), ChunkedLocalSpec(4, 16),
        SinkFullSpec(4, 8), MambaSpec(4, 1), MambaSpec(4, 0),
    )
    assert cfg.num_sink_blocks == 2
    assert cfg.row_capacity(5) == 16 + 1


def test_from_dict_ignores_unknown_keys_and_applies_overrides():
    cfg = PoolConfig.from_dict({**BASE_DICT, "kind": "config", "meta": {"x": 1}},
                               max_num_seqs=7)
    assert cfg == config(max_num_seqs=7)


@pytest.mark.parametrize(
    "changes, path",
    [
        ({"num_blocks": "10"}, "num_blocks"),
        ({"num_blocks": True}, "num_blocks"),
        ({"num_blocks": 10.5}, "num_blocks"),
        ({"enable_caching": 1}, "enable_caching"),
        ({"groups": "full"}, "groups"),
        ({"groups": [{"type": "full", "block_size": "4"}]}, "groups[0].block_size"),
        ({"groups": [{"type": "full"}]}, "groups[0]"),
        ({"groups": [{"block_size": 4}]}, "groups[0]"),
        ({"groups": [{"type": "nope", "block_size": 4}]}, "groups[0].type"),
        ({"groups": [{"type": "full", "block_size": 4},
                     {"type": "sliding_window", "block_size": 4, "sliding_window": "8"}]},
         "groups[1].sliding_window"),
        ({"hash_algorithm": 5}, "hash_algorithm"),
    ],
)
def test_from_dict_wrong_types_name_the_path(changes, path):
    """A wrong type or unknown group type is a ConfigError naming its path."""
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_dict({**BASE_DICT, **changes})
    assert e.value.field == path
    assert path in str(e.value)


def test_from_dict_rejects_a_non_mapping():
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_dict([BASE_DICT])
    assert e.value.field == "config"


def test_from_dict_validates():
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_dict({**BASE_DICT, "num_blocks": 1})
    assert e.value.field == "num_blocks"


def test_unknown_hash_algorithm_from_dict():
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_dict({**BASE_DICT, "hash_algorithm": "md5"})
    assert e.value.field == "hash_algorithm"


# -- files ------------------------------------------------------------------------------


TOML = """\
num_blocks = 24
hash_block_size = 4
max_model_len = 64
max_num_seqs = 8

[[groups]]
type = "full"
block_size = 4

[[groups]]
type = "sliding_window"
block_size = 4
sliding_window = 8
"""


def test_from_file_toml(tmp_path):
    p = tmp_path / "pool.toml"
    p.write_text(TOML)
    cfg = PoolConfig.from_file(p)
    assert cfg == PoolConfig(num_blocks=24, hash_block_size=4, max_model_len=64,
                             max_num_seqs=8,
                             groups=(FullSpec(4), SlidingWindowSpec(4, 8)))
    assert PoolConfig.from_file(str(p), num_blocks=30).num_blocks == 30


def test_from_file_json(tmp_path):
    p = tmp_path / "pool.json"
    p.write_text(json.dumps(BASE_DICT))
    assert PoolConfig.from_file(p) == config()


def test_from_trace_config_line():
    """Line 1 of a conformance trace is a valid config (extra keys ignored)."""
    path = TRACES / "hyb4-full-full-sw-sw-tiny-chat-s2310.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        line = json.loads(f.readline())
    cfg = PoolConfig.from_dict(line)
    assert cfg == PoolConfig(
        num_blocks=137, hash_block_size=16, max_model_len=512,
        groups=(FullSpec(16), FullSpec(16), SlidingWindowSpec(16, 64),
                SlidingWindowSpec(16, 64)),
    )


def test_every_trace_config_line_loads():
    paths = sorted(TRACES.glob("*.jsonl.gz"))
    assert len(paths) >= 166
    for path in paths:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            line = json.loads(f.readline())
        cfg = PoolConfig.from_dict(line)
        assert cfg.num_blocks == line["num_blocks"], path.name
        assert len(cfg.groups) == len(line["groups"]), path.name


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_file(tmp_path / "nope.toml")
    assert e.value.field == "config"


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_file(tmp_path)
    assert e.value.field == "config"


@pytest.mark.parametrize(
    "name, raw",
    [
        ("bad.toml", b"num_blocks = = 3\n"),
        ("bad.toml", b"\xff\xfe not utf-8"),
        ("bad.json", b"{\"num_blocks\": 10,"),
        ("bad.json", b""),
    ],
)
def test_invalid_file_content(tmp_path, name, raw):
    p = tmp_path / name
    p.write_bytes(raw)
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_file(p)
    assert e.value.field == "config"


def test_file_with_a_broken_rule_names_the_rule_field(tmp_path):
    p = tmp_path / "pool.toml"
    p.write_text(TOML.replace("sliding_window = 8", "sliding_window = 0"))
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_file(p)
    assert e.value.field == "groups[1].sliding_window"


@pytest.mark.parametrize(
    "old, new, path, hint, valid",
    [
        ("block_size = 4\n\n[[groups]]", "blocksize = 4\n\n[[groups]]", "groups[0].blocksize",
         "did you mean `block_size`? ", "block_size, type"),
        ("sliding_window = 8", "sliding_windw = 8", "groups[1].sliding_windw",
         "did you mean `sliding_window`? ", "block_size, sliding_window, type"),
        ("num_blocks = 24", "num_block = 24", "num_block", "did you mean `num_blocks`? ",
         "num_blocks, hash_block_size, max_model_len, groups, enable_caching, use_eagle, "
         "dcp_world_size, max_num_seqs, max_encoder_len, hash_algorithm, hash_seed, kv"),
        ("max_num_seqs = 8", "max_num_seqs = 8\ncolour = 1", "colour", "",
         "num_blocks, hash_block_size"),
        ("max_num_seqs = 8", "max_num_seqs = 8\n[kv]\nnum_layers = 1\nnum_kv_heads = 1\n"
         "head_size = 8\ndtyp = \"float32\"", "kv.dtyp", "did you mean `dtype`? ",
         "num_layers, num_kv_heads, head_size, dtype, layout"),
    ],
    ids=["group-typo", "second-group-typo", "top-typo", "top-no-match", "kv-typo"],
)
def test_a_file_with_an_unknown_key_is_refused_with_a_close_match(tmp_path, old, new, path,
                                                                   hint, valid):
    """A key no field has (a typo is the usual cause) is a ConfigError naming
    its path, the close match and the valid keys; before, a typo of an
    optional key was silently ignored and one of a required key was
    reported as the required field missing."""
    assert old in TOML
    p = tmp_path / "pool.toml"
    p.write_text(TOML.replace(old, new, 1))
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_file(p)
    assert e.value.field == path
    assert str(e.value).startswith(f"{path}: unknown key; {hint}valid keys: {valid}")


def test_a_json_file_with_an_unknown_key_is_refused(tmp_path):
    p = tmp_path / "pool.json"
    p.write_text(json.dumps({**BASE_DICT, "hash_seeds": "x"}))
    with pytest.raises(ConfigError, match="did you mean `hash_seed`") as e:
        PoolConfig.from_file(p)
    assert e.value.field == "hash_seeds"


def test_from_dict_strict_refuses_what_it_otherwise_ignores():
    data = {**BASE_DICT, "groups": [{"type": "full", "block_size": 4, "lora": 1}]}
    assert PoolConfig.from_dict(data) == config()
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_dict(data, strict=True)
    assert e.value.field == "groups[0].lora"
    # An unknown group type is decoding's to report, as without `strict`.
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_dict({**BASE_DICT, "groups": [{"type": "fulll", "block_size": 4}]},
                             strict=True)
    assert e.value.field == "groups[0].type"


def test_json_file_holding_a_list(tmp_path):
    p = tmp_path / "pool.json"
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_file(p)
    assert e.value.field == "config"


# -- canonical encoding -------------------------------------------------------------------


def test_equal_configs_encode_equal():
    """Equal configs give byte-equal to_json, whatever the key order they were
    loaded with; a different config gives different bytes."""
    a = PoolConfig.from_dict(BASE_DICT)
    b = PoolConfig.from_dict(dict(reversed(list(BASE_DICT.items()))))
    c = config()
    assert a == b == c
    assert a.to_json() == b.to_json() == c.to_json()
    assert a.to_json() != config(num_blocks=11).to_json()
    assert config(groups=(FullSpec(4), MLASpec(4))).to_json() != \
        config(groups=(MLASpec(4), FullSpec(4))).to_json()


@pytest.mark.parametrize(
    "cfg",
    [
        config(),
        config(groups=(FullSpec(4), SlidingWindowSpec(8, 24), MambaSpec(4, 2)),
               max_num_seqs=3, hash_seed="x", use_eagle=False),
        config(groups=(FullSpec(4), CrossAttentionSpec(4)), enable_caching=False,
               max_encoder_len=99),
        config(groups=(SinkFullSpec(4, 16),), hash_block_size=8, dcp_world_size=2,
               hash_algorithm="xxh3_128"),
        config(groups=(ChunkedLocalSpec(4, 8),)),
    ],
    ids=["full", "hybrid", "cross", "sink-dcp", "chunked"],
)
def test_round_trip_through_json(cfg):
    back = PoolConfig.from_json(cfg.to_json())
    assert back == cfg
    assert back.to_json() == cfg.to_json()
    assert PoolConfig.from_dict(cfg.to_dict()) == cfg


def test_from_json_of_invalid_bytes_is_a_config_error():
    """Minor inconsistency: from_file turns malformed JSON into ConfigError,
    from_json lets json.JSONDecodeError through."""
    with pytest.raises(ConfigError):
        PoolConfig.from_json(b"{")
