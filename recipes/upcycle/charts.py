"""The benchmark's PNG charts (matplotlib, Agg): teacher and student on one plot each, one colour per batch size;
context length on a log2 x axis.

``latency.png``: decode ms/token and prefill ms vs context; ``kv_bytes.png``: measured KV cache bytes vs context;
``quality.png``: strided perplexity and passkey accuracy (on a fixed [0, 1] axis) vs context.

Teacher and student often coincide (a student with half the KV bytes at batch 2 holds the teacher's bytes at batch
1; both at passkey accuracy 0), so every series stays visible where it lies under another: the teacher is drawn
first, wide, solid and with large open markers, the student on top of it, thin, dashed and with small filled ones.
"""
from __future__ import annotations

from purestep.core.io.cache import write_file

STYLE = {"teacher": dict(linestyle="-", linewidth=3.5, alpha=0.55, marker="o", markersize=9,
                         markerfacecolor="none", markeredgewidth=1.8, zorder=2),
         "student": dict(linestyle="--", linewidth=1.3, marker="s", markersize=4, zorder=3)}
OTHER = dict(linestyle=":", marker=".", zorder=4)
ACCURACY_LIMITS = (-0.04, 1.04)      # the accuracy axis: [0, 1], a margin so points at 0 and 1 are not cut


def _series(cells: list, key: str):
    """{(model, batch, new): ([contexts], [values])} over the measured cells."""
    out = {}
    for c in sorted(cells, key=lambda c: c["prompt_tokens"]):
        if c["status"] == "ok":
            xs, ys = out.setdefault((c["model"], c["batch"], c["new_tokens"]), ([], []))
            xs.append(c["prompt_tokens"])
            ys.append(c[key])
    return out


def _plot(ax, series: dict, title: str, ylabel: str) -> None:
    batches = sorted({b for _, b, _ in series})
    for (model, batch, new), (xs, ys) in series.items():
        ax.plot(xs, ys, **STYLE.get(model, OTHER), color=f"C{batches.index(batch)}",
                label=f"{model}, batch {batch}" + (f", +{new}" if len({n for *_, n in series}) > 1 else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7)


def draw(folder, results: dict) -> None:
    """``latency.png``, ``kv_bytes.png`` and ``quality.png`` in ``folder``."""
    import matplotlib.pyplot as plt
    for name, fig in figures(results).items():
        write_file(folder / f"{name}.png", lambda f: fig.savefig(f, format="png", dpi=100))   # never via a link
        plt.close(fig)


def figures(results: dict) -> dict:
    """The three charts as matplotlib figures, by file name (without ``.png``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = {}
    note = f"{results['device']}, {results['threads']} thread(s), {results['timing_dtype']}, median of " \
           f"{results['repeats']}"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _plot(axes[0], _series(results["cells"], "decode_ms_per_token"), f"decode ({note})", "ms / token")
    _plot(axes[1], _series(results["cells"], "prefill_ms"), "prefill (chunked)", "ms")
    fig.tight_layout()
    out["latency"] = fig

    fig, ax = plt.subplots(figsize=(6, 4))
    _plot(ax, _series(results["cells"], "kv_bytes_measured"), f"KV cache ({results['cache_dtype']}, measured)",
          "bytes")
    ax.set_yscale("log", base=2)
    fig.tight_layout()
    out["kv_bytes"] = fig

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    trained = results.get("trained_context")
    for rows, ax, key, title, ylabel in ((results["strided_perplexity"], axes[0], "perplexity",
                                          "held-out perplexity (strided)", "perplexity"),
                                         (results["passkey"], axes[1], "accuracy",
                                          "passkey retrieval (greedy)", "accuracy")):
        for i, model in enumerate(("teacher", "student")):
            pts = sorted((r["context"], r[key]) for r in rows if r["model"] == model and r.get(key) is not None)
            if pts:
                ax.plot(*zip(*pts), **STYLE[model], color=f"C{i}", label=model)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if trained:
            ax.axvline(trained, color="grey", lw=0.8, ls=":", label=f"student trained on {trained} tokens")
        if len(ax.get_lines()) > bool(trained):
            ax.legend(fontsize=8)
    axes[1].set_ylim(*ACCURACY_LIMITS)
    skipped = [k["reason"] for k in results.get("skipped") or [] if k["item"] == "passkey"]
    if skipped or not results["passkey"]:
        axes[1].text(0.5, 0.5, "skipped: " + skipped[0] if skipped else "not measured", ha="center", va="center",
                     wrap=True, fontsize=8, transform=axes[1].transAxes)
    fig.tight_layout()
    out["quality"] = fig
    return out
