"""The summary of a grid (``core.cli.grid``), read from each cell's own ``metrics.jsonl``.

Per cell: its status (``failed``: it stopped without finishing, a ``stopped.msgpack`` exists; ``finished``: a
final checkpoint exists; ``unfinished``), the last logged step, the final
and the best validation loss (``val/loss``: the last and the lowest logged), throughput (the median of the
logged ``tokens_per_sec``, each the mean over one log interval) and wall time (the last ``wall_hours``, which
counts every session of a resumed run, in seconds). A record that a resumed run logged again (a step at or
after the step it resumed from) replaces the earlier one for that step.

Per group of cells that differ only by ``seed``: the number of finished seeds and, over them, the mean and
spread (sample standard deviation, n - 1; empty for one seed) of each metric.

Written into the run root: ``grid.csv`` (the cells, then the groups), ``grid.md`` (two tables) and, when
matplotlib is installed, ``grid.png``: the final validation loss of every cell, one column per group, each seed a
point with its own colour and marker, beside the group's mean +- sample std; and, when a cell logged more than one
evaluation, validation loss against step beside it (one line per cell: a colour per group, a line style and
marker per seed). A grid that evaluates once per cell (at its end) gets the first panel alone, not single dots on
a curve axis whose legend shows lines that never draw.
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Sequence

from purestep.core.io.checkpoint import FINAL, STOPPED

METRICS = ("final_val_loss", "best_val_loss", "tokens_per_sec", "wall_seconds")


def read_records(path: Path) -> list[dict]:
    """The scalar records of a ``metrics.jsonl`` (events left out), one per (step, key): a later line wins."""
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue                                # a line cut short by a crash
        if not isinstance(record, dict) or "event" in record or "step" not in record:
            continue
        by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def cell_row(folder: Path) -> dict:
    """The summary values of one cell (None where its metrics hold none)."""
    records = read_records(folder / "metrics.jsonl")
    val = [(r["step"], v) for r in records if (v := _number(r.get("val/loss"))) is not None]
    tps = [v for r in records if (v := _number(r.get("tokens_per_sec"))) is not None]
    wall = [v for r in records if (v := _number(r.get("wall_hours"))) is not None]
    status = "failed" if (folder / STOPPED).exists() else "finished" if (folder / FINAL).exists() else "unfinished"
    return {"status": status,
            "step": records[-1]["step"] if records else None,
            "final_val_loss": val[-1][1] if val else None,
            "best_val_loss": min(v for _, v in val) if val else None,
            "tokens_per_sec": statistics.median(tps) if tps else None,
            "wall_seconds": wall[-1] * 3600 if wall else None,
            "val_curve": val}


def group_rows(cells: Sequence, rows: Sequence[dict], axes: Sequence[str]) -> list[dict]:
    """Mean and spread over the seeds of every group of finished cells that share their other values."""
    others = [a for a in axes if a != "seed"]
    groups: dict[tuple, list[dict]] = {}
    for cell, row in zip(cells, rows):
        key = tuple(cell.shown[a] for a in others)
        groups.setdefault(key, [])
        if row["status"] == "finished":
            groups[key].append(row)
    out = []
    for key, members in groups.items():
        group = {"group": ",".join(f"{a}={v}" for a, v in zip(others, key)) or "all", "seeds": len(members)}
        for m in METRICS:
            values = [r[m] for r in members if r[m] is not None]
            group[f"{m}_mean"] = statistics.fmean(values) if values else None
            group[f"{m}_std"] = statistics.stdev(values) if len(values) > 1 else None
        out.append(group)
    return out


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _write_csv(path: Path, cells, rows, groups, axes) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        out = csv.writer(fh)
        out.writerow(["cell", *axes, "status", "step", *METRICS])
        for cell, row in zip(cells, rows):
            out.writerow([cell.name, *(cell.shown[a] for a in axes), row["status"], _fmt(row["step"]),
                          *(repr(row[m]) if row[m] is not None else "" for m in METRICS)])
        out.writerow([])
        stats = [f"{m}_{s}" for m in METRICS for s in ("mean", "std")]
        out.writerow(["group", "seeds", *stats])
        for g in groups:
            out.writerow([g["group"], g["seeds"], *(repr(g[k]) if g[k] is not None else "" for k in stats)])


def _write_md(path: Path, cells, rows, groups, axes) -> None:
    lines = ["| cell | status | step | final val loss | best val loss | tokens/s | wall s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for cell, row in zip(cells, rows):
        lines.append(f"| `{cell.name}` | {row['status']} | {_fmt(row['step'])} | "
                     + " | ".join(_fmt(row[m]) for m in METRICS) + " |")
    lines += ["", "Over seeds (mean ± sample std of the finished cells):", "",
              "| group | seeds | final val loss | best val loss | tokens/s | wall s |", "|---|---:|---:|---:|---:|---:|"]
    for g in groups:
        cols = [_fmt(g[f"{m}_mean"]) + (f" ± {_fmt(g[f'{m}_std'])}" if g[f"{m}_std"] is not None else "")
                for m in METRICS]
        lines.append(f"| `{g['group']}` | {g['seeds']} | " + " | ".join(cols) + " |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
STYLES = ("-", "--", ":", "-.")


def _write_png(path: Path, cells, rows, axes) -> bool:
    """``figure`` saved as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = figure(cells, rows, axes)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def figure(cells, rows, axes):
    """The grid's chart (see the module docstring) as a matplotlib figure."""
    import matplotlib.pyplot as plt
    others = [a for a in axes if a != "seed"]
    groups = list(dict.fromkeys(tuple(c.shown[a] for a in others) for c in cells))
    seeds = list(dict.fromkeys(c.shown.get("seed") for c in cells))
    curves = any(len(row["val_curve"]) > 1 for row in rows)
    fig, panels = plt.subplots(1, 2 if curves else 1, figsize=(13 if curves else 7, 4.5), squeeze=False)
    _finals(panels[0][0], cells, rows, others, groups, seeds)
    if curves:
        _curves(panels[0][1], cells, rows, others, groups, seeds)
    fig.tight_layout()
    return fig


def _finals(ax, cells, rows, others, groups, seeds) -> None:
    """The final validation loss per group (a column and a colour each, as in the curves): the seeds side by side,
    a marker each; the mean +- sample std of the group beside them."""
    width = 0.5 / max(len(seeds), 1)
    values: dict[int, list[float]] = {}
    for j, seed in enumerate(seeds):
        drawn = False
        for cell, row in zip(cells, rows):
            if cell.shown.get("seed") == seed and row["final_val_loss"] is not None:
                g = groups.index(tuple(cell.shown[a] for a in others))
                ax.plot([g + (j - (len(seeds) - 1) / 2) * width], [row["final_val_loss"]], linestyle="none",
                        marker=MARKERS[j % len(MARKERS)], markersize=7, color=f"C{g % 10}", zorder=3)
                values.setdefault(g, []).append(row["final_val_loss"])
                drawn = True
        if drawn:   # the legend names the marker; the colour is the group's (the x axis names the groups)
            ax.plot([], [], linestyle="none", marker=MARKERS[j % len(MARKERS)], markersize=7, color="0.35",
                    label=f"seed {seed}" if seed is not None else "cell")
    spread = [(g, statistics.fmean(v), statistics.stdev(v)) for g, v in sorted(values.items()) if len(v) > 1]
    if spread:
        g, mean, std = zip(*spread)
        ax.errorbar(g, mean, yerr=std, fmt="_", markersize=22, color="black", capsize=6, elinewidth=1.2,
                    zorder=2, label="mean ± std over seeds")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([",".join(f"{a}={v}" for a, v in zip(others, key)) or "all" for key in groups],
                       rotation=20 if len(groups) > 4 else 0, fontsize=8)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_xlabel(", ".join(others))
    ax.set_ylabel("final validation loss")
    ax.set_title("final validation loss per cell")
    ax.grid(alpha=0.3, axis="y")
    if values:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no validation loss logged", ha="center", va="center", transform=ax.transAxes)


def _curves(ax, cells, rows, others, groups, seeds) -> None:
    """Validation loss against step, one line per cell: a colour per group, a line style and marker per seed."""
    for cell, row in zip(cells, rows):
        if row["val_curve"]:
            steps, losses = zip(*row["val_curve"])
            group = groups.index(tuple(cell.shown[a] for a in others))
            j = seeds.index(cell.shown.get("seed"))
            ax.plot(steps, losses, marker=MARKERS[j % len(MARKERS)], markersize=4, label=cell.name,
                    color=f"C{group % 10}", linestyle=STYLES[j % len(STYLES)])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("validation loss during training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def write_summary(root: Path, cells: Sequence, axes: Sequence[str]) -> list[Path]:
    """Write ``grid.csv``, ``grid.md`` and (with matplotlib) ``grid.png`` into ``root``; the paths written."""
    root.mkdir(parents=True, exist_ok=True)
    rows = [cell_row(cell.folder) for cell in cells]
    groups = group_rows(cells, rows, axes)
    written = [root / "grid.csv", root / "grid.md"]
    _write_csv(written[0], cells, rows, groups, axes)
    _write_md(written[1], cells, rows, groups, axes)
    if _write_png(root / "grid.png", cells, rows, axes):
        written.append(root / "grid.png")
    return written
