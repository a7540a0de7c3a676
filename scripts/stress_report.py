"""The outputs of scripts/numa_stress.py (a module it imports, not a
script): OUT/numa_stress.json (written atomically), OUT/numa_stress.md, and
PNG plots when matplotlib is installed (the `plot` extra)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import msgspec

from kvshm.workers.topology import allowed_cpus, discover, format_cpulist

PLOTS = ("throughput.png", "p99.png", "latency_cdf.png")
SOAK_ROWS = 40   # windows shown in the report's table (the JSON has every one)
MIB = 1 << 20


def document(setup, doc: dict) -> dict:
    """The JSON document: `nodes` (one row per node and step), `fairness`
    (one per step), `steps` (the totals), and what was run where."""
    cfg = setup.config
    steps, nodes, fairness = [], [], []
    for step in doc["steps"]:
        nodes += [{k: v for k, v in row.items() if not k.startswith("_")}
                  for row in step["rows"]]
        fairness.append({"policy": step["policy"], "clients": step["clients_per_node"],
                         "jain": step["fairness"], "jain_clients": step["fairness_clients"]})
        steps.append({k: v for k, v in step.items() if k != "rows"})
    real = discover()
    return {
        "command": " ".join(["scripts/numa_stress.py", *sys.argv[1:]]),
        "nodes": nodes,
        "fairness": fairness,
        "steps": steps,
        "host": {
            "cpus": format_cpulist(allowed_cpus()),
            "numa_nodes": [{"node": n.id, "cpus": format_cpulist(n.cpus)} for n in real],
            "virtual_nodes": any(n.virtual for n in setup.base.workers),
            "plan": setup.base.notes, "placement": setup.placement_note,
        },
        "coordinator": doc.get("coordinator"),
        "placements": doc.get("placements", []),
        "pool": {"num_blocks": cfg.num_blocks, "block_size": cfg.kv_block_size,
                 "kv": msgspec.to_builtins(cfg.kv), "kv_block_bytes": cfg.kv_block_bytes},
        "workload": dataclasses.asdict(setup.workload.synthetic),
        "engine": msgspec.to_builtins(setup.engine),
        "duration_s": setup.duration, "soak": bool(setup.args.soak),
        "kill_coordinator_every": setup.args.kill_coordinator_every,
        "interrupted": doc["interrupted"], "problems": doc["problems"],
    }


def write_json(path: Path, obj: dict) -> None:
    """Write `obj` to `path` atomically (a temporary file, then rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def write_outputs(setup, doc: dict) -> list[str]:
    """Write the JSON, the report and the plots; lines saying what was written."""
    out = Path(setup.args.out)
    out.mkdir(parents=True, exist_ok=True)
    full = document(setup, doc)
    write_json(out / "numa_stress.json", full)
    lines = [f"wrote {out / 'numa_stress.json'}"]
    (out / "numa_stress.md").write_text(markdown(full))
    lines.append(f"wrote {out / 'numa_stress.md'}")
    if doc["steps"]:
        lines.append(plots(doc["steps"], out))
    return lines


# -- the markdown report -------------------------------------------------------------------------
def _n(v, fmt: str = ",.0f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(full: dict) -> str:
    h = full["host"]
    pool = full["pool"]
    kv = pool["kv"]
    out = [
        "# numa_stress report", "",
        f"`{full['command']}`", "",
        f"Host: CPUs {h['cpus']}; NUMA nodes "
        + ", ".join(f"{n['node']} (CPUs {n['cpus']})" for n in h["numa_nodes"])
        + ("; the stress nodes are **virtual** (CPUs split, one memory node)"
           if h["virtual_nodes"] else "") + ".",
        "", *(f"- {note}" for note in h["plan"]), f"- {h['placement']}", "",
        f"Pool: {pool['num_blocks']:,} blocks of {pool['block_size']} tokens, K/V "
        f"{kv['num_layers']} layer(s) x {kv['num_kv_heads']} head(s) x {kv['head_size']} "
        f"{kv.get('dtype', 'float16')} ({pool['kv_block_bytes']:,} bytes a block).  "
        f"{full['duration_s']:g} s per step.", "",
    ]
    if full["interrupted"]:
        out += ["**Interrupted**: only the steps that finished are here.", ""]
    out += ["## Totals per step", "",
            "| policy | clients/node | ops/s | step p50 / p99 / p99.9 us | op p50 / p99 us "
            "| loop lag p99 us | fairness | coord CPU us/op | ops/frame | coord CPU "
            "| alloc/s | evict/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in full["steps"]:
        c = s["coordinator"]
        out.append(
            f"| {s['policy']} | {s['clients_per_node']} | {_n(s['ops_per_s'])} | "
            f"{_n(s['p50_us'])} / {_n(s['p99_us'])} / {_n(s['p999_us'])} | "
            f"{_n(s['op_p50_us'])} / {_n(s['op_p99_us'])} | {_n(s['loop_lag_us']['p99'])} | "
            f"{_n(s['fairness'], '.3f')} | {_n(c['cpu_us_per_op'], '.1f')} | "
            f"{_n(c['ops_per_frame'], '.1f')} | "
            f"{_n(c['cpu_util'], '.0%')} | {_n(c['allocated_per_s'])} | "
            f"{_n(c['evicted_per_s'])} |")
    out += ["", "## Per node", "",
            "| policy | clients/node | node | CPUs | ops/s | step p50 / p99 / p99.9 us "
            "| op p99 us | hit KiB/s own / other | written KiB/s | arena pages (local/all) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in full["nodes"]:
        pages = r["arena_pages"]
        where = ("-" if not pages else
                 f"{_n(pages['local'])} / {_n(pages['pages'])}")
        out.append(
            f"| {r['policy']} | {r['clients']} | {r['node']}{' (v)' if r['virtual'] else ''} | "
            f"{format_cpulist(r['cpus'])} | {_n(r['ops_per_s'])} | {_n(r['p50_us'])} / "
            f"{_n(r['p99_us'])} / {_n(r['p999_us'])} | {_n(r['op_p99_us'])} | "
            f"{_n(r['arena_read_own_bytes_per_s'] / 1024)} / "
            f"{_n(r['arena_read_other_bytes_per_s'] / 1024)} | "
            f"{_n(r['arena_written_bytes_per_s'] / 1024)} | {where} |")
    for s in full["steps"]:
        if "soak" in s:
            out += soak_markdown(s["soak"])
    if full["problems"]:
        out += ["", "## Problems", "", *(f"- {p}" for p in full["problems"])]
    out += ["", "docs/numa_stress.md says what each figure means.", ""]
    return "\n".join(out)


def soak_markdown(d: dict) -> list[str]:
    """The report's soak section: drift, restarts, windows over time,
    coordinator incarnations, the end state."""
    out = ["", "## Soak", "",
           f"Step round trip p50/p99: first tenth {_n(d['step_us_first_tenth']['p50'])}"
           f" / {_n(d['step_us_first_tenth']['p99'])} us, last tenth "
           f"{_n(d['step_us_last_tenth']['p50'])} / "
           f"{_n(d['step_us_last_tenth']['p99'])} us.  Probe op p50/p99: first "
           f"{_n(d['op_us_first_tenth']['p50'])} / {_n(d['op_us_first_tenth']['p99'])}"
           f" us, last {_n(d['op_us_last_tenth']['p50'])} / "
           f"{_n(d['op_us_last_tenth']['p99'])} us.",
           f"Coordinator RSS: {_n(d['rss_after_first_tenth'])} bytes after the first "
           f"tenth, {_n(d['rss_end'])} at the end (max {_n(d['rss_max'])}; growth "
           f"{_n(d['rss_growth_bytes'])} bytes, of which private "
           f"{_n(d['private_rss_growth_bytes'])})"
           + (" (across coordinator processes: see the incarnations below)."
              if len(d.get("incarnations", [])) > 1 else ".")]
    if d.get("restarts") is not None:
        st, ready, gap, c = d["stall_ms"], d["ready_ms"], d["reply_gap_ms"], d["clients"]
        out += ["", f"### Restarts (SIGKILL every {d['kill_coordinator_every']:g} s)", "",
                f"{len(d['restarts'])} restarts ({d['kills_skipped']} kills skipped: due "
                f"while a restart was under way).  Stall (kill -> first probe reply, the "
                f"slowest node): median {_n(st['median'], ',.1f')} ms, max "
                f"{_n(st['max'], ',.1f')} ms; coordinator ready after median "
                f"{_n(ready['median'], ',.1f')} ms, max {_n(ready['max'], ',.1f')} ms; "
                f"longest gap between a probe's replies {_n(gap['max'], ',.1f')} ms.  "
                f"Clients: restarts ridden {', '.join(map(str, c['coordinator_restarts']))}; "
                f"{_n(c['requests_resumed'])} requests resumed, {_n(c['requests_lost'])} "
                f"lost, {_n(c['recomputed_tokens'])} tokens recomputed; their stall (loss -> "
                f"resumed) median {_n(c['stall_ms']['median'])} ms, max "
                f"{_n(c['stall_ms']['max'])} ms.",
                "", "| at s | cause | pid killed -> new | ready ms | stall ms (per node) "
                "| reply gap ms | generation | segment check |",
                "|---|---|---|---|---|---|---|---|"]
        for r in d["restarts"]:
            nodes = ", ".join(_n(x, ",.0f") for x in r.get("stall_ms_by_node", []))
            if "error" in r:
                check = f"did not come back: {r['error']}"
            else:
                check = "clean" if r["check_clean"] else "FAILED: " + "; ".join(r["problems"])
            out.append(f"| {r['at_s']:.1f} | {r['cause']} | {r['killed_pid']} -> "
                       f"{r.get('pid', '-')} | {_n(r.get('ready_ms'), ',.0f')} | "
                       f"{_n(r.get('stall_ms'), ',.0f')} ({nodes}) | "
                       f"{_n(r.get('reply_gap_ms'), ',.0f')} | {_n(r.get('generation'))} "
                       f"| {check} |")
    rows = d.get("samples", [])
    if rows:
        every = -(-len(rows) // SOAK_ROWS)
        shown = rows[::every]
        if shown[-1] is not rows[-1]:
            shown.append(rows[-1])
        out += ["", f"### Over time (windows of {d['window_s']:g} s"
                + (f"; every {every}th shown, the JSON has all {len(rows)}" if every > 1
                   else "") + ")", "",
                "A window ending at `t *` holds a kill; `down`: no coordinator at its end.", "",
                "| t s | coordinator pid | RSS MiB | private MiB | free blocks | cached "
                "| requests | alloc/s | evict/s | ops/s per node | fairness | op p99 / max us |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in shown:
            out.append(
                f"| {r['t_s']:.1f}{' *' if r['restart'] else ''} | {r['pid'] or 'down'} | "
                f"{_mib(r['rss'])} | "
                f"{_mib(r['private_rss'])} | {_n(r['free_blocks'])} | "
                f"{_n(r['cached_blocks'])} | {_n(r['requests'])} | "
                f"{_n(r['allocated_per_s'])} | {_n(r['evicted_per_s'])} | "
                f"{' / '.join(_n(x) for x in r['ops_per_s_by_node'])} | "
                f"{_n(r['fairness'], '.3f')} | {_n(r['op_p99_us'])} / "
                f"{_n(r['op_max_us'])} |")
    inc = d.get("incarnations", [])
    if len(inc) > 1:
        out += ["", "### Coordinator processes (a restart is a new process)", "",
                "| # | pid | from s | to s | RSS MiB first / last / max "
                "| private MiB first / last / max |", "|---|---|---|---|---|---|"]
        for i, x in enumerate(inc):
            out.append(f"| {i} | {x['pid']} | {x['from_s']:.1f} | {x['to_s']:.1f} | "
                       f"{_mib(x['rss_first'])} / {_mib(x['rss_last'])} / "
                       f"{_mib(x['rss_max'])} | {_mib(x['private_first'])} / "
                       f"{_mib(x['private_last'])} / {_mib(x['private_max'])} |")
    end = d.get("end")
    if end:
        out += ["", f"At the end: the pool is {'whole' if end['whole'] else '**not whole**'} "
                f"({_n(end['num_free_blocks'])} of {_n(end['num_free_whole'])} blocks free, "
                f"{_n(end['num_requests'])} requests, segment check "
                f"{'clean' if end['check_clean'] else 'FAILED'}); left in /dev/shm: "
                f"{', '.join(end['segments_left']) or 'nothing'}; processes left: "
                f"{', '.join(end['processes_left']) or 'none'}."]
    return out


def _mib(v) -> str:
    return "-" if v is None else f"{v / MIB:,.1f}"


# -- plots ----------------------------------------------------------------------------------------
def plots(steps: list[dict], out: Path) -> str:
    """Throughput and p99 against clients per node, and the step latency
    CDF per node; returns a line saying what was written or skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("plots skipped: matplotlib is not installed (pip install matplotlib, or "
                "kvshm's `plot` extra); the JSON and the report have every figure")
    series: dict[tuple, list[dict]] = {}
    for s in steps:
        for r in s["rows"]:
            series.setdefault((s["policy"], r["node"]), []).append(r)
    policies = list(dict.fromkeys(s["policy"] for s in steps))
    label = (lambda pol, node: f"node {node}" if len(policies) == 1
             else f"{pol}, node {node}")
    colors = {key: f"C{i % 10}" for i, key in enumerate(series)}
    ramp = sorted({s["clients_per_node"] for s in steps})

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (pol, node), rows in series.items():
        ax.plot([r["clients"] for r in rows], [r["ops_per_s"] for r in rows], "o-",
                color=colors[pol, node], label=label(pol, node))
    for pol in policies:
        mine = [s for s in steps if s["policy"] == pol]
        ax.plot([s["clients_per_node"] for s in mine], [s["ops_per_s"] for s in mine], "s--",
                color="black", label="total" if len(policies) == 1 else f"{pol}, total")
    ax.set_ylim(bottom=0)
    _axes(ax, "coordinator ops/s", "throughput vs clients per node", ramp)
    fig.savefig(out / "throughput.png", dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (pol, node), rows in series.items():
        ax.plot([r["clients"] for r in rows], [r["p99_us"] for r in rows], "o-",
                color=colors[pol, node], label=f"{label(pol, node)}: scheduler step")
        ax.plot([r["clients"] for r in rows], [r["op_p99_us"] for r in rows], "x:",
                color=colors[pol, node], label=f"{label(pol, node)}: single op (probe)")
    ax.set_ylim(bottom=0)
    _axes(ax, "p99 round trip (us)", "p99 vs clients per node", ramp)
    fig.savefig(out / "p99.png", dpi=110, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for pol in policies:
        mine = [s for s in steps if s["policy"] == pol]
        shown = [mine[-1]] if len(mine) == 1 else [mine[0], mine[-1]]
        for s, style in zip(shown[::-1], ("-", "--")):
            for r in s["rows"]:
                xs = sorted(r["_batch_us"])
                if not xs:
                    continue
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.plot(xs, ys, style, color=colors[pol, r["node"]],
                        label=f"{label(pol, r['node'])}, {s['clients_per_node']}/node")
    ax.set_xscale("log")
    _axes(ax, "fraction of steps", "scheduler-step round trip CDF per node",
          xlabel="step batch round trip (us)")
    fig.savefig(out / "latency_cdf.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    names = list(PLOTS)
    soaks = [s["soak"] for s in steps if s.get("soak", {}).get("samples")]
    if soaks:
        soak_plot(plt, soaks[-1], out / "soak.png")
        names.append("soak.png")
    return "wrote " + ", ".join(str(out / name) for name in names)


def soak_plot(plt, d: dict, path: Path) -> None:
    """The soak over time: the coordinator's RSS, the pool's blocks, fairness
    and the probe's p99 per window; a dotted line at each restart."""
    rows = d["samples"]
    t = [r["t_s"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(7.2, 8.0), sharex=True)
    ax = axes[0]
    ax.plot(t, [_mb(r["rss"]) for r in rows], ".-", label="RSS")
    ax.plot(t, [_mb(r["private_rss"]) for r in rows], ".-", label="private RSS")
    ax.set_ylabel("coordinator MiB")
    ax = axes[1]
    ax.plot(t, [r["free_blocks"] for r in rows], "-", label="free blocks")
    ax.plot(t, [r["cached_blocks"] for r in rows], "-", label="cached blocks")
    ax.plot(t, [r["used_blocks"] for r in rows], "-", label="used blocks")
    ax.set_ylabel("blocks")
    ax = axes[2]
    ax.plot(t, [_nan(r["fairness"]) for r in rows], ".-", color="C0", label="fairness (Jain)")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("Jain's index")
    ax2 = ax.twinx()
    ax2.plot(t, [_nan(r["op_p99_us"]) for r in rows], ".:", color="C3",
             label="probe op p99 us")
    ax2.set_yscale("log")
    ax2.set_ylabel("op p99 (us)")
    ax2.legend(fontsize=7, loc="lower right")
    for ax in axes:
        for r in d.get("restarts") or []:
            ax.axvline(r["at_s"], color="grey", linestyle=":", linewidth=0.8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    axes[0].set_title("soak over time" + (" (dotted: coordinator restarts)"
                                          if d.get("restarts") else ""))
    axes[-1].set_xlabel("seconds into the soak")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _nan(v) -> float:
    return float("nan") if v is None else v


def _mb(v) -> float:
    return float("nan") if v is None else v / MIB


def _axes(ax, ylabel: str, title: str, ticks=None, xlabel: str = "clients per node") -> None:
    if ticks:
        ax.set_xticks(ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
