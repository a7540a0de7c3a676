"""docs/config.md against the code: one table row per field of PoolConfig,
KVShape and every group spec, in field order, with the field's type and
default; its examples (and the README's) load, and the README's fits an
ordinary machine."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest

from kvshm.core.errors import ConfigError
from kvshm.core.specs import GroupSpec, KVShape, PoolConfig
from kvshm.pool.lifecycle import pool_bytes

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "config.md"
STRUCTS = {cls.__name__: cls for cls in (PoolConfig, KVShape, *typing.get_args(GroupSpec))}
ROW = re.compile(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \| (.+) \|$")


def documented() -> dict[str, tuple[str, list[tuple[str, str, str, str]]]]:
    """Struct name -> (its heading, its table's rows: key, type, default, rule)."""
    out: dict[str, tuple[str, list]] = {}
    rows = None
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            m = re.match(r"#+ `(\w+)`", line)
            rows = None
            if m and m.group(1) in STRUCTS:
                rows = []
                out[m.group(1)] = (line, rows)
        elif rows is not None and (m := ROW.match(line)):
            rows.append(tuple(cell.strip() for cell in m.groups()))
    return out


def type_name(info: mi.Type) -> str:
    if isinstance(info, mi.UnionType):   # `X | None`: an optional X
        (info,) = [t for t in info.types if not isinstance(t, mi.NoneType)]
    if isinstance(info, mi.VarTupleType):
        return "array of tables"
    return {mi.IntType: "integer", mi.BoolType: "boolean", mi.StrType: "string",
            mi.FloatType: "float", mi.StructType: "table"}[type(info)]


def default_text(value) -> str:
    if value is msgspec.NODEFAULT:
        return "required"
    if value is None:
        return "unset"
    return f"`{json.dumps(value)}`"      # TOML spells these as JSON does


@pytest.mark.parametrize("name", STRUCTS)
def test_every_field_has_its_row(name):
    doc = documented()
    assert name in doc, f"docs/config.md has no section for {name}"
    heading, rows = doc[name]
    info = mi.type_info(STRUCTS[name])
    want = [(f.encode_name, type_name(f.type), default_text(f.default)) for f in info.fields]
    assert [row[:3] for row in rows] == want
    assert all(row[3] for row in rows)
    if info.tag is not None:
        assert f'`type = "{info.tag}"`' in heading


def test_the_examples_load(tmp_path):
    text = DOC.read_text()
    (toml,) = re.findall(r"```toml\n(.*?)```", text, re.S)
    path = tmp_path / "pool.toml"
    path.write_text(toml)
    config = PoolConfig.from_file(path)
    (js,) = re.findall(r"The same as JSON: `(.*?)`\.", text, re.S)
    assert PoolConfig.from_dict(json.loads(js.replace("\n", " ")), strict=True) == config
    assert pool_bytes(config) < 1.1 * 2**30          # "in 1 GiB of /dev/shm"
    refusal = re.search(r"^kvshm serve: (.*)$", text, re.M).group(1)
    bad = tmp_path / "bad.toml"
    bad.write_text(toml.replace("\nblock_size = 16", "\nblocksize = 16", 1))
    with pytest.raises(ConfigError) as e:
        PoolConfig.from_file(bad)
    assert str(e.value) == refusal


def test_the_readme_example_fits_an_ordinary_machine(tmp_path):
    """The README's TOML starts a coordinator as written: its segments fit in
    the /dev/shm of a machine with a few GB (its pages are touched only as
    blocks are used, but /dev/shm must have room for all of them)."""
    (toml,) = re.findall(r"```toml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    path = tmp_path / "pool.toml"
    path.write_text(toml)
    config = PoolConfig.from_file(path)
    assert config.kv is not None
    assert pool_bytes(config) <= 1.1 * 2**30
    assert config.num_blocks > config.blocks_for_request()   # holds a full-length request
