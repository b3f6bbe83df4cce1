"""The summary of a grid (``core.grid``), read from each cell's own ``metrics.jsonl``.

Per cell: its status (``failed``: it stopped without finishing, a ``stopped.msgpack`` exists; ``finished``: a
final checkpoint exists; ``unfinished``), the last logged step, the final
and the best validation loss (``val/loss``: the last and the lowest logged), throughput (the median of the
logged ``tokens_per_sec``, each the mean over one log interval) and wall time (the last ``wall_hours``, which
counts every session of a resumed run, in seconds). A record that a resumed run logged again (a step at or
after the step it resumed from) replaces the earlier one for that step.

Per group of cells that differ only by ``seed``: the number of finished seeds and, over them, the mean and
spread (sample standard deviation, n - 1; empty for one seed) of each metric.

Written into the run root: ``grid.csv`` (the cells, then the groups), ``grid.md`` (two tables) and, when
matplotlib is installed, ``grid.png`` (validation loss against step, one line per cell).
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Sequence

from core.checkpoint import FINAL, STOPPED

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


def _write_png(path: Path, cells, rows, axes) -> bool:
    """Validation loss against step, one line per cell: a colour per group, a line style per seed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = list(dict.fromkeys(tuple(c.shown[a] for a in axes if a != "seed") for c in cells))
    seeds = list(dict.fromkeys(c.shown.get("seed") for c in cells))
    styles = ("-", "--", ":", "-.")
    for cell, row in zip(cells, rows):
        if row["val_curve"]:
            steps, losses = zip(*row["val_curve"])
            group = groups.index(tuple(cell.shown[a] for a in axes if a != "seed"))
            ax.plot(steps, losses, marker="o", markersize=3, label=cell.name, color=f"C{group % 10}",
                    linestyle=styles[seeds.index(cell.shown.get("seed")) % len(styles)])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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
