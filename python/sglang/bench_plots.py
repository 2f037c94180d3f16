"""PNG plots of the benches' figures (``--plot-dir DIR``).

matplotlib is an optional extra (``pip install -e '.[plot]'``); the benches
check for it before they run (``require_matplotlib``), so a long run never
ends without its plots; their other output, ``--json FILE``, is checked here
too (``check_json_path``). Every plot is drawn from a bench's own JSON rows.
"""

import itertools
import os
import tempfile
from typing import Dict, List

from sglang.srt.utils.common import check_dir


def require_matplotlib() -> None:
    """ImportError with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "--plot-dir needs matplotlib: pip install -e '.[plot]'"
        ) from None


def check_json_path(parser, path) -> None:
    """A bench's ``--json`` file, checked before its run: a path, whose
    folder exists, not a folder itself, and writable (else the parser's
    error: a long run never ends unable to save its figures)."""
    if path is None:
        return
    if not path:
        parser.error("--json needs a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"--json {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        parser.error(f"--json {path} is a folder; give a file path")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            parser.error(f"--json {path}: not writable")
        return
    try:  # a file of its own (ranks may check the same path at once)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as e:
        parser.error(f"--json {path}: cannot write in {folder} ({e.strerror})")


def prepare_plot_dir(parser, path) -> None:
    """A bench's ``--plot-dir``, checked before its run: matplotlib is there
    (else the parser's error, with the install command), the folder made."""
    if path is None:
        return
    try:
        require_matplotlib()
    except ImportError as e:
        parser.error(str(e))
    check_dir(parser, "--plot-dir", path)


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def speedup_plot(rows: List[Dict], folder: str) -> str:
    """bench_one_batch: DSpark's speedup over plain decoding per temperature
    and batch size, with its 95% interval; 1.0 is break-even."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(rows) + 1.5), 3.2))
    labels = [f"T={r['temperature']:g}\nbs {r['batch_size']}" for r in rows]
    speedups = [r["speedup"] for r in rows]
    lo = [s - (r["speedup_ci95"][0] or s) for s, r in zip(speedups, rows)]
    hi = [(r["speedup_ci95"][1] or s) - s for s, r in zip(speedups, rows)]
    colors = ["#3b75af" if r["temperature"] == 0 else "#ef8636" for r in rows]
    ax.bar(labels, speedups, yerr=[lo, hi], capsize=3, color=colors)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    for x, s in enumerate(speedups):
        ax.text(x, s / 2, f"{s:.2f}x", ha="center", color="white", fontsize=8)
    ax.set_ylabel("speedup over plain (95% CI)")
    budget = rows[0].get("verify_budget", "")
    ax.set_title(f"DSpark vs plain decoding (verify budget {budget})", fontsize=10)
    return _save(fig, folder, "speedup.png")


def phases_plot(rows: List[Dict], folder: str, phases: Dict[str, tuple]) -> str:
    """bench_one_batch --phases: each engine's step as stacked phases, in
    plain steps, one pair of bars per temperature and batch size.
    ``phases``: engine -> its phase names, in order."""
    plt = _pyplot()
    names = list(dict.fromkeys(n for ns in phases.values() for n in ns))
    color = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 * len(rows) + 2), 3.6))
    labels, drawn = [], set()
    for x, (r, engine) in enumerate((r, e) for r in rows for e in phases):
        spans, bottom = r["phases_plain_steps"][engine], 0.0
        for n in phases[engine]:
            label = None if n in drawn else n
            ax.bar(x, spans[n], bottom=bottom, color=color[n], label=label)
            drawn.add(n)
            bottom += spans[n]
        labels.append(f"{engine}\nT={r['temperature']:g} bs {r['batch_size']}")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("time, in plain decode steps")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Where a decode step's time goes", fontsize=10)
    return _save(fig, folder, "phases.png")


def step_times_plot(rows: List[Dict], folder: str) -> str:
    """bench_dspark_step: mean ms per scheduler step of before / after /
    fixed per concurrency, every block's mean as a dot."""
    plt = _pyplot()
    variants = ("before", "after", "fixed")
    fig, axes = plt.subplots(
        1, len(rows), figsize=(3.2 * len(rows), 3.2), squeeze=False
    )
    for ax, r in zip(axes[0], rows):
        for i, name in enumerate(variants):
            blocks = r["block_ms_per_step"][name]
            ax.bar(
                i, r["ms_per_step"][name], color=["#999999", "#d62728", "#2ca02c"][i]
            )
            ax.plot([i] * len(blocks), blocks, "k.", markersize=3)
        ax.set_xticks(range(3), variants)
        ax.set_title(
            f"C={r['concurrency']}: after/fixed {r['after_over_fixed']['median']:.3f}",
            fontsize=9,
        )
        ax.set_ylabel("ms per scheduler step")
    fig.suptitle("num_token_non_padded: before / after / fixed", fontsize=10)
    return _save(fig, folder, "step_times.png")


def dp_bytes_plot(result: Dict, folder: str) -> str:
    """bench_dspark_step --enable-dp-attention: hidden-state bytes the MoE
    dispatch sends per decode step, per rank and variant, with the real
    rows' copies as the floor."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    labels, sent, floor = [], [], []
    for rank, rank_rows in enumerate(result["ranks"]):
        for r in rank_rows:
            for name, v in r["variants"].items():
                per = v["per_step"]
                labels.append(f"r{rank} C={r['concurrency']}\n{name}")
                sent.append(sum(m["hidden_bytes"] for m in per.values()))
                floor.append(
                    sum(m["real_row_copies"] for m in per.values()) * v["row_bytes"]
                )
    xs = range(len(labels))
    ax.bar(xs, sent, color="#3b75af", label="hidden bytes sent")
    ax.plot(xs, floor, "r_", markersize=18, label="real row copies x row bytes")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("bytes per decode step")
    ax.legend(fontsize=7)
    ax.set_title("MoE dispatch under DP attention", fontsize=10)
    return _save(fig, folder, "dp_bytes.png")


def scaling_plots(result: Dict, folder: str) -> List[str]:
    """bench_scaling: a PNG per config, its step time against batch size
    (projected lines, measured markers, one style per context) and DSpark's
    projected speedup against accepted length (x: measured)."""
    plt = _pyplot()
    paths = []
    for config in result["configs"]:
        name = config["name"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
        _scaling_steps(left, [r for r in result["rows"] if r["config"] == name])
        left.set_title(f"{name}: projected (lines), measured (markers)", fontsize=9)
        _scaling_speedup(right, [s for s in result["speedup"] if s["config"] == name])
        paths.append(_save(fig, folder, f"{name}.png"))
        plt.close(fig)
    return paths


def _scaling_steps(ax, rows: List[Dict]) -> None:
    from matplotlib import ticker

    contexts = sorted({r["context"] for r in rows})
    styles = list(zip(("--", "-", ":", "-."), ("o", "s", "^", "D")))
    for engine, color in (("plain", "tab:blue"), ("dspark", "tab:orange")):
        for ctx, (line, marker) in zip(contexts, itertools.cycle(styles)):
            mine = sorted(
                (r for r in rows if r["engine"] == engine and r["context"] == ctx),
                key=lambda r: r["batch_size"],
            )
            bs = [r["batch_size"] for r in mine]
            ms = [r["projected_ms"] for r in mine]
            ax.plot(bs, ms, line, color=color, label=f"{engine} ctx {ctx}")
            got = [r for r in mine if r["measured_ms"] is not None]
            ax.plot(
                [r["batch_size"] for r in got],
                [r["measured_ms"] for r in got],
                marker,
                color=color,
                fillstyle="none",
            )
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="ms / step")
    numbers = ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.set_xticks(sorted({r["batch_size"] for r in rows}))
    ax.xaxis.set_major_formatter(numbers)
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.yaxis.set_minor_locator(ticker.LogLocator(subs=(2.0, 5.0)))
    ax.yaxis.set_major_formatter(numbers)
    ax.yaxis.set_minor_formatter(numbers)
    ax.legend(fontsize=6)


def _scaling_speedup(ax, speedups: List[Dict]) -> None:
    """At the largest context measured (else the largest)."""
    measured = [s["context"] for s in speedups if "measured" in s]
    ctx = max(measured or [s["context"] for s in speedups])
    for s in speedups:
        if s["context"] != ctx:
            continue
        taus = sorted(s["projected"], key=int)
        (line,) = ax.plot(
            [int(t) for t in taus],
            [s["projected"][t] for t in taus],
            marker=".",
            label=f"bs {s['batch_size']}",
        )
        if "measured" in s:
            tau, speedup = s["measured_accept_length"], s["measured"]
            ax.plot(tau, speedup, "x", color=line.get_color(), markersize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="accepted length (tokens per verify)", ylabel="speedup")
    ax.set_title(f"DSpark speedup, ctx {ctx} (x: measured)", fontsize=9)
    ax.legend(fontsize=6)
