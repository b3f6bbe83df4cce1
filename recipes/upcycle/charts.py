"""The benchmark's PNG charts (matplotlib, Agg): teacher (solid) and student (dashed) on one plot each, one
colour per batch size; context length on a log2 x axis.

``latency.png``: decode ms/token and prefill ms vs context; ``kv_bytes.png``: measured KV cache bytes vs context;
``quality.png``: strided perplexity and passkey accuracy vs context.
"""
from __future__ import annotations

STYLE = {"teacher": "-", "student": "--"}


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
        ax.plot(xs, ys, STYLE.get(model, ":"), marker="o", color=f"C{batches.index(batch)}",
                label=f"{model}, batch {batch}" + (f", +{new}" if len({n for *_, n in series}) > 1 else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=7)


def draw(folder, results: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    note = f"{results['device']}, {results['threads']} thread(s), {results['timing_dtype']}, median of " \
           f"{results['repeats']}"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _plot(axes[0], _series(results["cells"], "decode_ms_per_token"), f"decode ({note})", "ms / token")
    _plot(axes[1], _series(results["cells"], "prefill_ms"), "prefill (chunked)", "ms")
    fig.tight_layout()
    fig.savefig(folder / "latency.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    _plot(ax, _series(results["cells"], "kv_bytes_measured"), f"KV cache ({results['cache_dtype']}, measured)",
          "bytes")
    ax.set_yscale("log", base=2)
    fig.tight_layout()
    fig.savefig(folder / "kv_bytes.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for rows, ax, key, title, ylabel in ((results["strided_perplexity"], axes[0], "perplexity",
                                          "held-out perplexity (strided)", "perplexity"),
                                         (results["passkey"], axes[1], "accuracy",
                                          "passkey retrieval (greedy)", "accuracy")):
        for model in ("teacher", "student"):
            pts = sorted((r["context"], r[key]) for r in rows if r["model"] == model and r.get(key) is not None)
            if pts:
                ax.plot(*zip(*pts), STYLE[model], marker="o", label=model)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    trained = results.get("trained_context")
    if trained:
        for ax in axes:
            ax.axvline(trained, color="grey", lw=0.8, ls=":")
    fig.tight_layout()
    fig.savefig(folder / "quality.png", dpi=100)
    plt.close(fig)
