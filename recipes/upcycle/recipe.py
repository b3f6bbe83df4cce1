"""Upcycling: ``purestep recipe=upcycle teacher=PATH``: a Llama teacher becomes a student with a smaller KV cache.

Pipeline: load the teacher -> build the student by **surgery** (``student=dba``: decoupled bottleneck attention,
GQA-aware, partial RoPE at the teacher's own frequencies, exact at full rank: ``models/dba.py``, ``models/surgery.py``;
``student=mla``: DeepSeek-V2's MLA form, one latent per token and one shared RoPE key: ``models/mla.py``,
``models/mla_surgery.py``; MHA2MLA, TransMLA, SVD-LLM) -> **blockwise** distillation of every block against the
teacher's (LoLCATs' attention transfer, MOHAWK's hidden-state alignment: ``recipes/upcycle/blockwise.py``) ->
**global** fine-tune of the whole student (next-token CE + Hinton KD on the teacher's logits, through
``recipes.train.loop.Loop``) -> **verify** against thresholds on held-out windows -> **benchmark** (perplexity, latency,
KV bytes, parameters). ``phases=`` picks the phases after the surgery (always run: it builds the student).

Each phase lives in its own subfolder of the run folder (``surgery/``, ``blockwise/``, ``global/``,
``verify/``, ``benchmark/``) with its own checkpoints and TensorBoard events. Rerunning the same command skips
the finished phases and resumes the unfinished one from its newest good checkpoint (by the step stored in the
file, not by mtime). The teacher's tokenizer tokenizes ``data=``; every held-out number comes from the test half
of its validation split, which no phase trains or selects on. Everything that can fail on bad input is checked
before the run folder is touched, and a rerun that would change the student (other dims, teacher, data) is
refused instead of mixing two students in one folder.
"""
from __future__ import annotations

import json
import time
from contextlib import nullcontext


from purestep.core.io import checkpoint as ckpt
from purestep.core.config import GateFailed, UserError
from purestep.core.data.text import EvalBatches
from purestep.core.data.documents import prepare_text
from purestep.core.parallel import distributed
from purestep.recipes.train.config import refuse_mesh_parallel
from purestep.core.device import resolve_device
from purestep.core.io.logging import Logger, format_duration, progress
from purestep.core.step import Parallel
from purestep.core.cli.runs import claim, run_folder
from purestep.core.tree import cast, fingerprint, size
from purestep.models import dba, kv_budget, llama, mla_surgery
from purestep.models.loading import module_of
from purestep.recipes.distill.teacher import load_teacher
from purestep.recipes.train.loop import donates
from purestep.recipes.train.optimizer import make_optimizer
from purestep.recipes.train.setup import sharded_layout
from purestep.optim.health import GradientHealth
from purestep.recipes.upcycle import benchmark as upcycle_bench, blockwise as bw_loop, gates, report
from purestep.recipes.upcycle.teacher_io import BlockIOCache, TeacherSource
from purestep.recipes.upcycle.config import Config, PHASES  # noqa: F401  (Config: the recipe's keys, for purestep)
from purestep.recipes.upcycle.phases import (FINAL, Context, Data, finished, load_student, phase_summary, run_global, run_surgery,
                                    run_verify, surgery_settings, write_json)

DESCRIPTION = "teacher -> DBA or MLA student (small KV cache): surgery, blockwise, global, verify, benchmark"

PRESETS = {
    "ci": {"block_size": 32, "eval_windows": 4, "calib_tokens": 512, "blockwise.steps": 40,
           "blockwise.batch_size": 4, "blockwise.warmup_steps": 5, "blockwise.log_every": 10, "global.steps": 10,
           "global.batch_size": 4, "global.warmup_steps": 2, "global.eval_every": 5, "global.eval_batches": 2,
           "global.log_every": 5, "verify.windows": 2,
           "benchmark.prompt_tokens": (16, 64), "benchmark.new_tokens": (4,), "benchmark.batches": (1, 2),
           "benchmark.repeats": 3, "benchmark.ppl_contexts": (16, 32), "benchmark.ppl_tokens": 512,
           "benchmark.passkey_contexts": (192, 256, 384), "benchmark.passkey_trials": 3,
           "benchmark.task_limit": 5},
}




def resolve_dims(cfg: Config, tcfg) -> None:
    """Fill the unset student dims from ``kv_reduction`` and the teacher's head (explicit dims win), in place:
    dba's ``sem_dim geo_dim v_dim`` (``rope_pairs_shared``: a plain Llama's, sem_dim 0 and v_dim = geo_dim), mla's
    ``kv_lora_rank qk_rope_head_dim`` (``mla_surgery.dims_for_reduction``) and its ``latent_weight``."""
    try:
        if cfg.student == "mla":
            derived = mla_surgery.dims_for_reduction(tcfg.n_kv_heads, tcfg.head_dim, cfg.kv_reduction)
            keys, derived = ("kv_lora_rank", "qk_rope_head_dim", "latent_weight"), (derived[1], derived[0], "fed")
            if cfg.kv_budget:            # the budget's greedy sets the latent widths at the surgery
                keys, derived = keys[1:], derived[1:]
        else:
            derived = dba.dims_for_reduction(tcfg.head_dim, cfg.kv_reduction, plain=cfg.rope_pairs_shared)
            keys = ("sem_dim", "geo_dim", "v_dim")
            if cfg.kv_budget:            # the budget's greedy sets sem_dim and v_dim per layer at the surgery
                keys, derived = keys[1:2], derived[1:2]
    except ValueError as e:
        raise UserError(f"kv_reduction={cfg.kv_reduction:g} for this teacher: {e}") from None
    for key, value in zip(keys, derived):
        if getattr(cfg, key) is None:
            setattr(cfg, key, value)


def dims_line(cfg: Config, tcfg) -> str:
    """The chosen dims with both models' KV bytes per token (printed once the inputs are checked)."""
    if cfg.student == "mla" and cfg.kv_budget:
        per_t, per_s = 2 * tcfg.n_kv_heads * tcfg.head_dim, cfg.kv_budget / 2 / tcfg.n_layers
        total = kv_budget.budget_latent_total(cfg.kv_budget, tcfg.n_layers, cfg.qk_rope_head_dim)
        dims = (f"kv_budget={cfg.kv_budget} B: {total} latent dims over {tcfg.n_layers} layers (per-layer ranks at "
                f"the surgery) + qk_rope_head_dim={cfg.qk_rope_head_dim} (MLA; teacher {tcfg.n_kv_heads} KV heads x "
                f"head_dim {tcfg.head_dim}")
    elif cfg.student == "mla":
        per_t, per_s = 2 * tcfg.n_kv_heads * tcfg.head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim
        dims = (f"kv_lora_rank={cfg.kv_lora_rank} qk_rope_head_dim={cfg.qk_rope_head_dim} (MLA; teacher "
                f"{tcfg.n_kv_heads} KV heads x head_dim {tcfg.head_dim}")
    elif cfg.kv_budget:
        per_t, per_s = 2 * tcfg.n_kv_heads * tcfg.head_dim, cfg.kv_budget / 2 / tcfg.n_layers
        total = kv_budget.budget_dba_total(cfg.kv_budget, tcfg.n_layers, tcfg.n_kv_heads, cfg.geo_dim)
        dims = (f"kv_budget={cfg.kv_budget} B: {total} sem_dim + v_dim per KV head over {tcfg.n_layers} layers "
                f"(per-layer widths at the surgery) + geo_dim={cfg.geo_dim} (teacher {tcfg.n_kv_heads} KV heads x "
                f"head_dim {tcfg.head_dim}")
    else:
        per_t, per_s = 2 * tcfg.n_kv_heads * tcfg.head_dim, tcfg.n_kv_heads * (cfg.sem_dim + cfg.geo_dim + cfg.v_dim)
        dims = f"sem_dim={cfg.sem_dim} geo_dim={cfg.geo_dim} v_dim={cfg.v_dim} (teacher head_dim {tcfg.head_dim}"
    kv_t, kv_s = llama.kv_bytes_per_token(tcfg), round(tcfg.n_layers * per_s * 2)
    return (f"upcycle: dims {dims}, kv_reduction={cfg.kv_reduction:g}); KV cache per token (bf16) teacher "
            f"{kv_t:,} B, student {kv_s:,} B: {per_t / per_s:.2f}x smaller")


def _validate_mla(cfg: Config, tcfg) -> None:
    """student=mla's dims and teacher against ``mla_surgery``'s checks, as one UserError."""
    if tcfg.qkv_bias:
        raise UserError(f"teacher={cfg.teacher} has q/k/v biases (Qwen2); student=mla (DeepSeek-V2's format) has no "
                        f"attention biases to carry them: use student=dba")
    if tcfg.sliding_window:
        raise UserError(f"teacher={cfg.teacher} attends through a sliding window; student=mla attends to the whole "
                        f"context: use student=dba")
    try:
        mla_surgery.kept_pairs(tcfg.head_dim, cfg.qk_rope_head_dim)
        if not cfg.kv_budget:
            mla_surgery.check_rank(tcfg, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    except ValueError as e:
        raise UserError(f"kv_lora_rank/qk_rope_head_dim for this teacher: {e}") from None
    if cfg.kv_budget:
        d_r = cfg.qk_rope_head_dim
        full = min(tcfg.n_kv_heads * (2 * tcfg.head_dim - d_r), tcfg.d_model)
        _validate_budget(cfg, tcfg, 1, (kv_budget.MIN_RANK, full), d_r,
                         f"{kv_budget.MIN_RANK} latent dim + qk_rope_head_dim={d_r}", f"{full} latent dims")


def _validate_budget(cfg: Config, tcfg, values: int, live: tuple, rope: int, least: str, most: str) -> None:
    """kv_budget in whole cached tokens' rows (``values`` per unit: 1 for mla, n_kv_heads for dba) between every
    layer's minimum (``live[0]`` live units + ``rope`` RoPE dims, ``least`` in words) and the teacher's own cache
    (and at most every layer's ``live[1]``, ``most``), as one UserError."""
    L = tcfg.n_layers
    if cfg.kv_budget % (2 * values):
        raise UserError(f"kv_budget={cfg.kv_budget} is not a whole number of a layer's dims: each dim caches "
                        f"{values} bf16 values (one per KV head, 2 bytes each): give a multiple of {2 * values}")
    low = 2 * values * L * (live[0] + rope)
    high = min(llama.kv_bytes_per_token(tcfg), 2 * values * L * (live[1] + rope))
    if not low <= cfg.kv_budget <= high:
        per = f" x {values} KV heads" if values > 1 else ""
        raise UserError(f"kv_budget={cfg.kv_budget} does not fit this teacher: need {low} <= kv_budget <= {high} "
                        f"bytes per token ({L} layers{per}, each at least {least}, at most the teacher's "
                        f"{llama.kv_bytes_per_token(tcfg)} B and {most} a layer)")


def _validate(cfg: Config, teacher, corpus) -> tuple:
    """Every check on the inputs, before the run folder is touched. Returns (dev tokens, test tokens)."""
    if teacher.arch != "llama":
        raise UserError(f"teacher={cfg.teacher} is a {teacher.arch} model; the teacher must be a Llama")
    tcfg = teacher.config
    resolve_dims(cfg, tcfg)
    upcycle_bench.check_contexts(cfg.benchmark, tcfg, "benchmark")
    if tcfg.vocab_size < corpus.tokenizer.vocab_size:
        raise UserError(f"teacher={cfg.teacher}: its vocabulary ({tcfg.vocab_size}) is smaller than its "
                        f"tokenizer's ({corpus.tokenizer.vocab_size})")
    if cfg.student == "mla":
        _validate_mla(cfg, tcfg)
    else:
        _validate_dba(cfg, tcfg)
    half = len(corpus.val) // 2
    dev, test = corpus.val[:half], corpus.val[half:]
    need = cfg.block_size + 1
    if min(len(dev), len(test)) < need:
        raise UserError(f"data={cfg.data}: the validation split ({len(corpus.val):,} tokens) is too small to halve "
                        f"into dev and test windows of {need} tokens; give more text or a smaller block_size")
    return dev, test


def _validate_dba(cfg: Config, tcfg) -> None:
    """student=dba's dims against the teacher's head, as one UserError."""
    if cfg.kv_budget:
        _validate_dba_budget(cfg, tcfg)
        return
    try:
        dba.DBAConfig.from_teacher(tcfg, sem_dim=cfg.sem_dim, geo_dim=cfg.geo_dim, v_dim=cfg.v_dim)
    except ValueError as e:
        raise UserError(f"sem_dim/geo_dim/v_dim for this teacher (head_dim {tcfg.head_dim}): {e}") from None
    if cfg.sem_dim > tcfg.head_dim - cfg.geo_dim:
        raise UserError(f"sem_dim={cfg.sem_dim} > head_dim - geo_dim = {tcfg.head_dim - cfg.geo_dim}: the no-RoPE "
                        f"score has no more rank than that")
    if cfg.v_dim > tcfg.head_dim:
        raise UserError(f"v_dim={cfg.v_dim} > the teacher's head_dim={tcfg.head_dim}")
    if cfg.rope_pairs_shared and (cfg.sem_dim or cfg.v_dim != cfg.geo_dim):
        raise UserError(f"rope_pairs_shared=true builds a plain Llama student: it needs sem_dim=0 and v_dim=geo_dim "
                        f"(got sem_dim={cfg.sem_dim}, geo_dim={cfg.geo_dim}, v_dim={cfg.v_dim}); leave them unset to "
                        f"derive them from kv_reduction")


def _validate_dba_budget(cfg: Config, tcfg) -> None:
    """student=dba with kv_budget: geo_dim against the teacher's head, the budget between one value dim (and one
    no-RoPE key dim when geo_dim is 0) and every layer's full widths (``models.surgery``'s spectra: at most
    min(head_dim - geo_dim, d) key and min(head_dim, d) value dims), as one UserError."""
    key_min = 0 if cfg.geo_dim else 1
    try:
        dba.DBAConfig.from_teacher(tcfg, sem_dim=key_min, geo_dim=cfg.geo_dim, v_dim=1)
    except ValueError as e:
        raise UserError(f"geo_dim for this teacher (head_dim {tcfg.head_dim}): {e}") from None
    hd, d, g = tcfg.head_dim, tcfg.d_model, cfg.geo_dim
    key_max, v_max = min(hd - g, d), min(hd, d)
    _validate_budget(cfg, tcfg, tcfg.n_kv_heads, (key_min + kv_budget.MIN_RANK, key_max + v_max), g,
                     f"{key_min} sem_dim + {kv_budget.MIN_RANK} v_dim + geo_dim={g}",
                     f"{key_max} sem_dim + {v_max} v_dim")


def _check_existing(cfg: Config, folder) -> None:
    """resume=never refuses any existing phase; a finished surgery with other settings is refused always."""
    phases = [folder / p for p in ("surgery", *PHASES)]
    if cfg.resume == "never" and any(p.exists() and any(p.iterdir()) for p in phases):
        raise UserError(f"out={folder} already holds an upcycle run and resume=never would mix a new run into it; "
                        f"choose another out= (or name=), or delete that folder")
    path = folder / "surgery" / FINAL
    if path.exists():
        old = {"rope_pairs_shared": False, "student": "dba", "kv_budget": 0,   # runs from before these keys
               **ckpt.read_meta(path).get("settings", {})}
        new = surgery_settings(cfg)
        changed = [f"{k}={old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]
        if changed:
            raise UserError(f"out={folder} holds a student built with other settings ({', '.join(changed)}); use "
                            f"another out= (or name=), or delete that folder to start over")


def _record_time(folder, phase: str, seconds: float) -> dict:
    """``timings.json``: wall seconds per phase, summed over the sessions of this run."""
    path = folder / "timings.json"
    timings = json.loads(path.read_text()) if path.exists() else {}
    timings[phase] = timings.get(phase, 0.0) + seconds
    write_json(path, timings)
    return timings


def run(cfg: Config):
    if not cfg.teacher:
        raise UserError("recipe=upcycle needs teacher=PATH (a purestep checkpoint or run folder, a Hugging Face "
                        "folder, a .gguf file, or smollm2)")
    refuse_mesh_parallel(cfg.parallel, "upcycle")
    dist, device = distributed.init(resolve_device(cfg.device), cfg.parallel)
    if cfg.blockwise.cache_teacher and dist.enabled and "blockwise" in cfg.phases:
        raise UserError("blockwise.cache_teacher=true under torchrun: the cache is keyed by one process's batches; "
                        "drop it (each rank then runs the teacher on its own rows)")
    folder = run_folder(cfg.out, cfg.name, "upcycle")
    start = time.perf_counter()
    teacher = load_teacher(cfg.teacher, device, cfg.teacher_dtype, recipe="upcycle")
    if teacher.tokenizer is None:
        raise UserError(f"teacher={cfg.teacher} ({teacher.format}) has no tokenizer; upcycle tokenizes data= "
                        f"with the teacher's own")
    corpus = prepare_text(cfg.data, teacher.tokenizer)
    dev, test = _validate(cfg, teacher, corpus)
    _check_existing(cfg, folder)
    per = 4 if cfg.eval_windows % 4 == 0 else 2 if cfg.eval_windows % 2 == 0 else 1
    heldout = EvalBatches(test, per, cfg.block_size, cfg.eval_windows // per, device=device)
    ctx = Context(cfg, folder, device, teacher, Data(corpus, dev, heldout), dist)
    # the first write: a second run on this folder stops here, naming this one (rank 0 writes for every rank)
    with claim(folder) if dist.is_main else nullcontext():
        if dist.is_main:
            _record_time(folder, "load", time.perf_counter() - start)
        results = _run_phases(ctx, teacher, corpus, dev, test)
    distributed.shutdown(dist)
    return results


def _run_phases(ctx: Context, teacher, corpus, dev, test):
    """Surgery, then the trained phases, verify and benchmark, each skipped when already done."""
    cfg, folder = ctx.cfg, ctx.folder
    dist = ctx.dist
    ctx.say(dims_line(cfg, teacher.config))
    ctx.say(f"upcycle: teacher {teacher.source} ({teacher.format}), {size(teacher.params) / 1e6:.1f}M params, "
        f"{teacher.config.n_layers} layers, {teacher.config.n_heads} heads / {teacher.config.n_kv_heads} KV heads "
        f"x {teacher.config.head_dim}; data {corpus.meta['source']}: {len(corpus.train):,} train / "
        f"{len(dev):,} dev / {len(test):,} test tokens; phases surgery,{','.join(cfg.phases)}; run folder {folder}")

    def timed(phase, fn, *args, summary=False):
        t0 = time.perf_counter()
        with dist.main_first() if summary else nullcontext():
            out = fn(*args)   # a summary: rank 0 evaluates and writes it, the others then read it
        if dist.is_main:
            _record_time(folder, phase, time.perf_counter() - t0)
        return out

    with dist.main_first():   # rank 0 runs the surgery and writes the student, the others load it
        student, scfg = timed("surgery", run_surgery, ctx)
    surgery_report = ckpt.read_meta(folder / "surgery" / FINAL)["report"]
    stages = {"teacher": surgery_report["teacher_loss"],
              "surgery": timed("surgery", phase_summary, ctx, "surgery", student, scfg, summary=True)["loss"]}
    label = "surgery"
    for phase, train in (("blockwise", run_blockwise), ("global", run_global)):
        if phase not in cfg.phases:
            continue
        student, stopped = timed(phase, train, ctx, student, scfg)
        if stopped:
            ctx.say(f"{stopped}; rerun the same command to continue")
            return None
        stages[phase] = timed(phase, phase_summary, ctx, phase, student, scfg, summary=True)["loss"]
        label = phase
    results = {"stages": stages}
    if not dist.is_main:   # verify and benchmark: rank 0 alone (the others wait at the end)
        return results
    if "verify" in cfg.phases:
        results["verify"] = timed("verify", run_verify, ctx, student, scfg, f"{label}/{FINAL}")
    if "benchmark" in cfg.phases:
        path = folder / "benchmark" / "results.json"
        stored = json.loads(path.read_text()) if path.exists() else {}
        if stored.get("stages") == stages and stored.get("settings") == upcycle_bench.settings(cfg.benchmark) \
                and not stored.get("failed"):       # a benchmark with a failed item measures again
            progress(f"benchmark: done ({path})")
            results["benchmark"] = json.loads(path.read_text())
        else:
            results["benchmark"] = timed("benchmark", upcycle_bench.run_benchmark, ctx, student, scfg, stages)
    timings = json.loads((folder / "timings.json").read_text())
    total = sum(timings.values())
    progress("upcycle: done in " + format_duration(total) + " (" + ", ".join(
        f"{k} {format_duration(v)}" for k, v in timings.items()) + "); held-out perplexity " + ", ".join(
        f"{k} {upcycle_bench.ppl(v):.3f}" for k, v in stages.items())
        + f"; student: recipe=generate init={folder / label}")
    results["timings"] = timings
    try:
        _judge_gates(ctx, results, stages, scfg)
    except GateFailed as e:
        missed = e
    else:
        missed = None
    # a benchmark item that failed (reported, the rest measured): exit EXIT_INCOMPLETE, after every report
    upcycle_bench.check_failed(results.get("benchmark") or {}, folder / "benchmark",
                               also=f"; gate failed: {missed}" if missed else "")
    if missed:
        raise missed
    return results


def _judge_gates(ctx: Context, results: dict, stages: dict, scfg) -> None:
    """The ``verify.max_*``/``min_*`` gates, after every report is written (``recipes/upcycle/gates.py``)."""
    vc = ctx.cfg.verify
    if all(getattr(vc, g) is None for g in gates.GATES) or not {"verify", "benchmark"} & set(ctx.cfg.phases):
        return
    losses = {"teacher": stages["teacher"], "student": list(stages.values())[-1]}
    kv = {"teacher": llama.kv_bytes_per_token(ctx.teacher.config), "student": module_of(scfg).kv_bytes_per_token(scfg)}
    verdicts = gates.judge(vc, losses, kv, results.get("benchmark"))
    if "benchmark" in results:
        results["benchmark"]["gates"] = verdicts
        report.write(ctx.folder / "benchmark", results["benchmark"], say=ctx.say)
    gates.enforce(verdicts, ctx.folder, vc.on_fail, ctx.say)


def run_blockwise(ctx: Context, student: dict, scfg):
    """Set up and run the blockwise phase (resuming from its newest checkpoint). Returns (params, stop reason). The
    step donates its state as every run's does (``recipes.train.loop.donates``): ``student``'s trained tensors become
    the state's and are written in place."""
    cfg, bw, t = ctx.cfg, ctx.cfg.blockwise, ctx.teacher
    folder = ctx.folder / "blockwise"
    if finished(ctx, "blockwise", bw.steps):
        return load_student(folder / FINAL, ctx.device)[0], ""
    optimizer = make_optimizer(bw_loop.optimizer_spec(bw.lr, bw.warmup_steps, bw.steps))
    dist, layout = ctx.dist, blockwise_layout(ctx, student, optimizer)

    def start(params):
        return bw_loop.init_state(params, optimizer, bw.train, scfg.n_layers, cfg.seed, cfg.dtype)

    state = start(layout.shard_params(student) if layout else student)
    resume = ckpt.latest(folder)
    if resume is not None:   # fsdp: this rank reads its cut
        state = bw_loop.restore(resume, state if layout is None else start(cast(student, device="meta")), state,
                                ctx.device, layout)
    batches = ctx.data.corpus.batches(bw.batch_size, cfg.block_size, cfg.seed, device=ctx.device, rank=dist.rank,
                                 world_size=dist.world_size)
    source = TeacherSource(t.params, t.config, batches, match=bw.match)
    if bw.cache_teacher:
        n = bw.cache_batches or bw.steps
        identity = {"teacher": fingerprint(t.params), "data": ctx.data.corpus.path, "seed": cfg.seed,
                    "batch_size": bw.batch_size, "block_size": cfg.block_size}
        source.cache = BlockIOCache.open_or_build(source, n, identity, say=progress)
    health = GradientHealth(bw_loop.split(state.params, bw.train)[0], every=bw.log_every) if bw.health else None
    donate = donates(bw_loop.loop_config(bw))   # as every run of the shared loop: the loop gives each state up
    step_fn = bw_loop.make_step(scfg, optimizer, bw_loop.Blocks.of(bw), precision=cfg.dtype, compile=cfg.compile,
                                donate=donate, health=health,
                                parallel=Parallel(dist.all_reduce_mean if dist.enabled and not layout else None,
                                                  shard=layout))
    state = bw_loop.owned(state, bw.train, t.params) if donate else state
    trainable = size(bw_loop.split(student, bw.train)[0])
    ctx.say(f"blockwise: {bw.mode}, {bw.loss} on {bw.match} outputs, training {bw.train} "
        f"({trainable / 1e6:.2f}M params) of all {scfg.n_layers} blocks at once, up to {bw.steps} steps of {bw.batch_size} x {cfg.block_size} tokens"
        + (f"; resuming from {resume} at step {int(state.step)}" if resume is not None else ""))
    with Logger(folder, enabled=dist.is_main) as logger:
        if resume is None:
            logger.hparams({"blockwise": vars(bw)})
        state, stopped = bw_loop.run(bw, state, step_fn, source, folder, lambda: ctx.extra("blockwise", scfg), logger,
                                     resume_folder=ctx.folder, dist=dist, layout=layout, health=health)
    return (layout.gather_state(state) if layout else state).params, stopped


def blockwise_layout(ctx: Context, student: dict, optimizer):
    """Under parallel=fsdp, the blockwise phase's layout (``core.parallel.shard``): the whole student sharded as the
    global phase shards it, the optimizer state of the trainable part following it; None otherwise."""
    train = ctx.cfg.blockwise.train
    return sharded_layout(ctx.dist, student, lambda p: optimizer.init(bw_loop.split(p, train)[0]), ctx.cfg.dtype)
