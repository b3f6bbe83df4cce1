"""Every recipe's default command at a small size on the device, and docs/upcycle.md's SmolLM2 2x-KV upcycle sized to
the time it is given: the jobs ``recipes.bench.gpu.jobs.run_jobs`` runs.

``recipe=standard`` trains first (the teacher and init of the rest); then, side by side: distillation online and
from an offline cache, the upcycle through its benchmark, compression, HF and GGUF export, generation, the LR
range test, fp16 training, Muon, on-policy distillation with the generalised JSD, the shared-RoPE-pairs upcycle and
its HF and GGUF export as a plain Llama, and ``torchrun`` with ``parallel=ddp`` and ``parallel=fsdp`` (NCCL on
CUDA, one rank: this machine has one GPU). The tiny mode keeps the same shape with fewer commands and steps,
uncompiled (it runs in the test suite on a CPU).
"""
from __future__ import annotations

import json
from pathlib import Path

from purestep.recipes.bench.gpu.jobs import Job, bin_run, torchrun

UPCYCLE_BATCH = 8   # windows per blockwise and global step of the SmolLM2 upcycle


def user_jobs(device: str, tiny: bool, data: str) -> list[Job]:
    """The recipes' commands as users run them (compiled where that is the recipe's default)."""
    dev = f"device={device}"
    steps = 8 if tiny else 200
    few = 4 if tiny else 100
    size = ["preset=tiny", "model.d_model=32", "block_size=32", "batch_size=4", "compile=false"] if tiny else \
           ["preset=small"]
    evals = ["eval_every=0", "eval_batches=2", "sample_tokens=0"] if tiny else ["eval_every=100"]
    standard = Job("standard", bin_run("recipe=standard", f"data={data}", *size, *evals, f"steps={steps}",
                                       "out=standard", dev))
    train = lambda name, *extra: bin_run(*extra, f"data={data}", *evals, f"out={name}", dev)  # noqa: E731
    distill_size = ["model.d_model=32", "model.n_layers=1", "block_size=32", "batch_size=4", "compile=false"] \
        if tiny else []
    jobs = [standard,
            Job("distill", train("distill", "recipe=distill", "teacher=standard", *distill_size, f"steps={few}"),
                ("standard",)),
            Job("export_gguf", bin_run("recipe=export", "init=standard", "format=gguf", "out=export-gguf"),
                ("standard",), requires=("gguf",)),
            Job("ddp", torchrun(1, "recipe=standard", "parallel=ddp", f"data={data}", *size, *evals,
                                f"steps={few}", "dtype=bf16", "out=ddp", dev))]
    if tiny:
        return jobs
    cache_args = [f"data={data}", "teacher=standard", f"steps={few}", dev]
    jobs += [
        Job("distill_cache", bin_run("recipe=distill_cache", *cache_args, "out=kd-cache", "k=32"), ("standard",)),
        Job("distill_from_cache", train("distill-cached", "recipe=distill", "teacher=standard", "cache=kd-cache",
                                        f"steps={few}"), ("distill_cache",)),
        Job("upcycle", bin_run("recipe=upcycle", "teacher=standard", f"data={data}", "out=upcycle", dev,
                               "blockwise.steps=50", "global.steps=50", "benchmark.prompt_tokens=64,256",
                               "benchmark.batches=1,4"), ("standard",)),
        Job("compress", bin_run("recipe=compress", "teacher=standard", f"data={data}", "d_compressed=32",
                                f"steps={few}", "out=compress", dev), ("standard",)),
        Job("export_hf", bin_run("recipe=export", "init=standard", "format=hf", "out=export-hf"), ("standard",),
            requires=("safetensors",)),
        Job("generate", bin_run("recipe=generate", "init=standard", "prompt=def ", "max_new_tokens=64",
                                "temperature=0", dev), ("standard",)),
        Job("lr_find", bin_run("recipe=lr_find", f"data={data}", "model.d_model=128", "model.n_layers=2",
                               "out=lr-find", dev)),
        Job("standard_fp16", train("standard-fp16", "recipe=standard", "preset=small", "dtype=fp16",
                                   f"steps={few}")),
        Job("fsdp", torchrun(1, "recipe=standard", "parallel=fsdp", f"data={data}", *size, *evals,
                             f"steps={few}", "dtype=bf16", "out=fsdp", dev)),
        Job("standard_muon", train("standard-muon", "recipe=standard", "preset=small", "optimizer=muon",
                                   f"steps={few}")),
        Job("distill_on_policy", train("distill-on-policy", "recipe=distill", "teacher=standard", "on_policy=0.5",
                                       "kl=jsd", "beta=0.5", f"steps={few}"), ("standard",)),
        Job("upcycle_shared_pairs", bin_run("recipe=upcycle", "teacher=standard", f"data={data}", "out=upcycle-shared",
                                            dev, "rope_pairs_shared=true", "blockwise.steps=30", "global.steps=30",
                                            "benchmark.prompt_tokens=64", "benchmark.batches=1"), ("standard",)),
        Job("export_shared_hf", bin_run("recipe=export", "init=upcycle-shared/global", "format=hf",
                                        "out=export-shared-hf"), ("upcycle_shared_pairs",), requires=("safetensors",)),
        Job("export_shared_gguf", bin_run("recipe=export", "init=upcycle-shared/global", "format=gguf",
                                          "out=export-shared-gguf"), ("upcycle_shared_pairs",), requires=("gguf",)),
    ]
    return jobs


def smollm2_upcycle(teacher: str, device: str, data: str, blockwise_steps: int, global_steps: int,
                    tiny: bool = False) -> Job:
    """docs/upcycle.md's SmolLM2-135M 2x-KV upcycle (``kv_reduction=2``'s 0/32/32 dims, attention-output blockwise
    matching over a cached teacher, then the global fine-tune), with bf16 steps on a GPU and the given budget;
    ``tiny``: the recipes section's ``standard`` run as the teacher, windows and benchmark cut down."""
    sizes = dict(block_size=64, eval_windows=2, calib_tokens=256, **{"blockwise.cache_batches": 2,
                 "verify.windows": 2, "benchmark.prompt_tokens": 64, "benchmark.batches": 1,
                 "benchmark.repeats": 1, "benchmark.passkey_contexts": 128, "benchmark.passkey_trials": 1,
                 "benchmark.ppl_tokens": 256}) if tiny else \
        dict(block_size=256, eval_windows=16, calib_tokens=4096, **{"blockwise.cache_batches": 32,
             "verify.windows": 4, "benchmark.prompt_tokens": "256,1024", "benchmark.batches": "1,8"})
    return Job("smollm2_kv2x" if not tiny else "upcycle_tiny", bin_run(
        "recipe=upcycle", f"teacher={teacher}", f"data={data}", "out=smollm2-kv2x", f"device={device}",
        *(["dtype=bf16"] if device == "cuda" else []), *(f"{k}={v}" for k, v in sizes.items()),
        "blockwise.match=attention", "blockwise.cache_teacher=true", f"blockwise.steps={blockwise_steps}",
        f"blockwise.batch_size={UPCYCLE_BATCH}", "blockwise.lr=1e-3", "blockwise.warmup_steps=10", f"global.steps={global_steps}",
        f"global.batch_size={UPCYCLE_BATCH}", "global.lr=1.5e-4", "global.min_lr=1.5e-5", "global.warmup_steps=10",
        "global.eval_every=0", "global.eval_batches=2", "global.log_every=10"),
        needs=("standard",) if tiny else (), section="upcycle")


def upcycle_results(folder: Path, batch: int = UPCYCLE_BATCH) -> dict:
    """The upcycle's held-out perplexities (teacher, after each phase), KV bytes and training tokens, read from
    its run folder (``benchmark/results.json``, each phase's ``metrics.jsonl``)."""
    results = json.loads((folder / "benchmark" / "results.json").read_text())
    block = results["trained_context"]
    tokens = {phase: _last_step(folder / phase / "metrics.jsonl") * batch * block for phase in ("blockwise", "global")}
    ratio = results["student_over_teacher"]
    out = {"teacher_perplexity": results["teacher"]["perplexity"], "student_perplexity":
           results["student"]["perplexity"], "perplexity_ratio": ratio["perplexity"],
           "kv_bytes_ratio": ratio["kv_bytes_per_token_analytic"], "stage_losses": results["stages"],
           "tokens": tokens, "passkey": results.get("passkey"), "timings": _json(folder / "timings.json")}
    out["summary"] = (f"perplexity {out['student_perplexity']:.2f} vs teacher {out['teacher_perplexity']:.2f} "
                      f"(ratio {out['perplexity_ratio']:.3f}), KV bytes x{out['kv_bytes_ratio']:.2f}, "
                      f"{tokens['blockwise']:,} blockwise + {tokens['global']:,} global tokens")
    return out


def _last_step(path: Path) -> int:
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []
    return max(steps, default=0)


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None
