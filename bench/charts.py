"""The bench scripts' one chart writer: grouped bar charts as SVG, drawn by matplotlib.

bar_chart(title, ylabel, groups, series, ymax, fmt, hlines, group_marks, note) returns the
SVG text; bench/run.py and bench/kv_bench.py write it under docs/charts/.
"""
import io

import matplotlib

matplotlib.use("svg")  # no display: render straight to SVG
matplotlib.rcParams["svg.hashsalt"] = "lockstep"  # stable element ids from run to run
import matplotlib.pyplot as plt  # noqa: E402

GOAL = "#c00"    # goals are drawn red and labelled on the right
ANCHOR = "#777"  # anchors from the papers grey, labelled on the left


def bar_chart(title, ylabel, groups, series, ymax, fmt, hlines=(), group_marks=None, note=None):
    """groups: [name]; series: [(name, colour, [value or None per group])]; values above
    ymax are cut at ymax and labelled with a "+"; hlines: [(value, label, colour)] across
    the plot; group_marks: {group index: [(value, label)]}, a dashed line over that group
    (a label starting with "goal" is a goal, any other an anchor)."""
    fig, ax = plt.subplots(figsize=(7.6, 4.2), dpi=100)
    n = max(1, len(series))
    width = min(0.8 / n, 0.4)
    for si, (name, colour, vals) in enumerate(series):
        xs = [gi + (si - (n - 1) / 2) * width for gi, v in enumerate(vals) if v is not None]
        ys = [v for v in vals if v is not None]
        bars = ax.bar(xs, [min(max(v, 0), ymax) for v in ys], width * 0.95, color=colour, label=name)
        ax.bar_label(bars, labels=[fmt(v) + ("+" if v > ymax else "") for v in ys], fontsize=8, padding=2)
    for gi, marks in (group_marks or {}).items():
        for v, label in marks:
            colour = GOAL if label.startswith("goal") else ANCHOR
            ax.hlines(v, gi - 0.45, gi + 0.45, colors=colour, linestyles="dashed", linewidth=2)
            x, align = (gi + 0.45, "right") if colour == GOAL else (gi - 0.45, "left")
            ax.annotate(label, (x, v), xytext=(0, 3), textcoords="offset points", ha=align, fontsize=8,
                        color=colour)
    for v, label, colour in hlines:
        ax.axhline(v, color=colour, linestyle="dashed", linewidth=1.5)
        ax.annotate(label, (1, v), xycoords=("axes fraction", "data"), xytext=(-2, 3),
                    textcoords="offset points", ha="right", fontsize=8, color=colour)
    ax.set_xticks(range(len(groups)), [str(g) for g in groups], fontsize=9)
    ax.set_ylim(0, ymax)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: fmt(v)))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11, fontweight="bold")
    ax.grid(axis="y", color="#ddd")
    ax.set_axisbelow(True)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=max(1, len(series)), frameon=False, fontsize=9)
    if note:
        fig.text(0.01, 0.01, note, fontsize=8, color="#555")
    fig.tight_layout()
    out = io.StringIO()
    # no date: with the fixed hash salt, the same data gives the same file
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
    return out.getvalue()
