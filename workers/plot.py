"""`kvshm run --plot FILE.png`: one figure of the run(s): the prefix hit rate
and the tokens served per second over time, and the time-to-first-token
distribution, each run (shared, isolated) in its own colour.  matplotlib is
an optional extra (`pip install 'kvshm[plot]'`); `require()` says so up
front, before anything runs."""

from __future__ import annotations

from pathlib import Path

from kvshm.core.metrics import percentile

COLOURS = {"shared": "tab:blue", "isolated": "tab:orange"}


def require() -> None:
    """Raise ValueError (a usage error) unless matplotlib can be imported."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvshm[plot]'") from None
    del plt


def plot_runs(results, path: str | Path) -> None:
    """Draw `results` (RunResults) into the PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hit_ax, rate_ax, ttft_ax) = plt.subplots(1, 3, figsize=(15, 4.2))
    for res in results:
        colour = COLOURS.get(res.mode)
        times = [t for t, *_ in res.timeline]
        hits = [h / p if p else 0.0 for _, p, h, _ in res.timeline]
        hit_ax.plot(times, [100 * h for h in hits], label=res.mode, color=colour)
        rates = [(b[3] - a[3]) / (b[0] - a[0]) for a, b in zip(res.timeline, res.timeline[1:])
                 if b[0] > a[0]]
        rate_ax.plot(times[1:len(rates) + 1], rates, label=res.mode, color=colour)
        ttft = sorted(res.totals.ttft_ms)
        if ttft:
            ttft_ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))],
                         label=f"{res.mode} (p50 {percentile(ttft, 50):,} ms)", color=colour)
    hit_ax.set(title="prefix hit rate (cumulative)", xlabel="s", ylabel="% of prompt tokens")
    rate_ax.set(title="tokens served per second", xlabel="s", ylabel="tokens/s")
    ttft_ax.set(title="time to first token (CDF)", xlabel="ms", ylabel="fraction of requests")
    for ax in (hit_ax, rate_ax, ttft_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
