"""The upcycle recipe's phases other than blockwise: surgery, global fine-tune, verify (benchmark:
``recipes/upcycle/benchmark.py``; blockwise: ``recipes/upcycle/blockwise.py``; the driver: ``recipes/upcycle/recipe.py``).

Every phase writes into its own subfolder of the run folder and is *done* when its result file exists
(``surgery/final.msgpack``, ``global/final.msgpack``, ``verify/report.json``); a phase that is done is skipped
on a rerun. Held-out numbers always come from the **test half** of the validation split (the windows in
``Context.data.heldout``); the global phase's periodic validation uses the other (dev) half, so nothing reported
was used to steer training or was trained on.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.io.cache import write_json
from purestep.core.config import UserError, to_dict
from purestep.core.data.text import Corpus, EvalBatches
from purestep.core.io.logging import progress
from purestep.core.parallel.distributed import Dist
from purestep.core.step import make_eval_step
from purestep.models import blockwise, kv_budget, llama, losses, mla, mla_surgery, surgery
from purestep.models.loading import ARCHS, LoadedModel, model_entry, module_of
from purestep.recipes.distill.teacher import compute_view
from purestep.recipes.orchestrator.driver import orchestrate
from purestep.recipes.train import setup
from purestep.recipes.train.loop import Loop, Measures, Validation, build_steps, evaluate
from purestep.recipes.upcycle.config import Config, global_train_config

FINAL = "final.msgpack"


class Data(NamedTuple):
    """The run's text, tokenized with the teacher's tokenizer: the corpus (its training split and tokenizer), the
    first half of the validation split (``dev``: the global phase's validation) and windows of its second half
    (``heldout``: every reported held-out number)."""
    corpus: Corpus
    dev: object              # token array
    heldout: EvalBatches


@dataclass
class Context:
    """What every phase reads: the run's keys, its folder, the device, the frozen teacher, the data, the ranks."""
    cfg: Config
    folder: Path
    device: torch.device
    teacher: LoadedModel
    data: Data
    dist: Dist = Dist()      # the ranks of a run under torchrun (parallel=ddp|fsdp: the trained phases)

    def say(self, message: str) -> None:
        """A progress line (``core.io.logging.progress``), from rank 0 only."""
        if self.dist.is_main:
            progress(message)

    def extra(self, phase: str, scfg) -> dict:
        """What every student checkpoint carries, so ``load_model``/``recipe=generate`` read it as a model."""
        return {"model": model_entry(scfg), "tokenizer": self.data.corpus.tokenizer.to_dict(), "recipe": "upcycle",
                "phase": phase, "config": to_dict(self.cfg)}


@torch.no_grad()
def heldout_loss(module, params: dict, cfg, batches) -> float:
    """Mean next-token CE over fixed windows (equal lengths: the token-weighted mean), one host transfer."""
    return torch.stack([module.loss(params, b, cfg) for b in batches]).mean().item()


def ppl(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def phase_summary(ctx: Context, phase: str, params: dict, scfg) -> dict:
    """``<phase>/heldout.json``: the student's held-out loss after this phase (computed once)."""
    path = ctx.folder / phase / "heldout.json"
    if path.exists():
        return json.loads(path.read_text())
    ctx.say(f"{phase}: evaluating the student on the held-out windows")
    loss = heldout_loss(module_of(scfg), params, scfg, ctx.data.heldout)
    summary = {"phase": phase, "loss": loss, "perplexity": ppl(loss), "windows": len(ctx.data.heldout) *
               ctx.data.heldout.starts.shape[1], "block_size": ctx.cfg.block_size}
    write_json(path, summary)
    ctx.say(f"{phase}: held-out loss {loss:.4f}, perplexity {ppl(loss):.2f}")
    return summary


def finished(ctx: Context, phase: str, steps: int) -> bool:
    """Whether the trained ``phase`` is done: its final checkpoint exists and was trained for ``steps`` (or
    beyond). A phase whose ``steps`` grew since continues from that checkpoint: its held-out summary is stale
    then and is dropped, and a blockwise phase that grows under a finished global phase is refused."""
    folder = ctx.folder / phase
    if not (folder / FINAL).exists():
        return False
    meta = ckpt.read_meta(folder / FINAL)
    trained_for = (meta.get("train") or {}).get("steps", (meta.get("config") or {}).get(phase, {}).get("steps"))
    if meta["step"] >= steps or trained_for == steps:
        ctx.say(f"{phase}: done ({folder / FINAL})")
        return True
    if phase == "blockwise" and (ctx.folder / "global" / FINAL).exists():
        raise UserError(f"blockwise.steps={steps} asks for more than the {meta['step']} steps of {folder}, but the "
                        f"global phase in {ctx.folder / 'global'} was trained from that student; use another out= "
                        f"(or move global/ away to retrain it)")
    (folder / "heldout.json").unlink(missing_ok=True)
    ctx.say(f"{phase}: continuing from step {meta['step']} to {steps} ({phase}.steps grew)")
    return False


def load_student(path: Path, device) -> tuple[dict, object]:
    from purestep.core.config import from_dict
    top = ckpt.load(path, device=device)
    return top["state"]["params"], from_dict(ARCHS[top["model"]["arch"]][1], top["model"]["config"])


# ----------------------------------------------------------------------------------------------------------
# surgery

def surgery_settings(cfg: Config) -> dict:
    """The keys that define the student; a rerun into the same folder must not change them."""
    dims = ({"kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
             "latent_weight": cfg.latent_weight} if cfg.student == "mla" else {})
    return {"teacher": cfg.teacher, "data": cfg.data, "student": cfg.student, "sem_dim": cfg.sem_dim,
            "geo_dim": cfg.geo_dim, "v_dim": cfg.v_dim, **dims, "kv_budget": cfg.kv_budget,
            "surgery_method": cfg.surgery_method,
            "rope_pairs_shared": cfg.rope_pairs_shared, "calib_tokens": cfg.calib_tokens,
            "block_size": cfg.block_size, "seed": cfg.seed}


def calibration_tokens(ctx: Context) -> torch.Tensor:
    """``calib_tokens`` tokens of the training split (whole windows, their own seed stream)."""
    cfg = ctx.cfg
    windows = math.ceil(cfg.calib_tokens / cfg.block_size)
    return ctx.data.corpus.batches(windows, cfg.block_size, cfg.seed + 7919, device=ctx.device).get(0)["x"]


def run_surgery(ctx: Context) -> tuple[dict, object]:
    folder, cfg, t = ctx.folder / "surgery", ctx.cfg, ctx.teacher
    path = folder / FINAL
    if path.exists():
        ctx.say(f"surgery: done ({path})")
        return load_student(path, ctx.device)
    start = time.perf_counter()
    calib = calibration_tokens(ctx)
    # the factorizations need the teacher's weights in at least fp32 (a bf16-held teacher is widened here)
    if cfg.student == "mla":
        width = (f"kv_budget {cfg.kv_budget} B" if cfg.kv_budget else f"kv_lora_rank {cfg.kv_lora_rank}")
        ctx.say(f"surgery: {cfg.surgery_method} on {calib.numel():,} calibration tokens (training split) into MLA, "
                f"{width}, qk_rope_head_dim {cfg.qk_rope_head_dim}, latent_weight {cfg.latent_weight}")
        width = ({"latent_total": kv_budget.budget_latent_total(cfg.kv_budget, t.config.n_layers,
                                                                cfg.qk_rope_head_dim)}
                 if cfg.kv_budget else {"kv_lora_rank": cfg.kv_lora_rank})
        student, dims, report = mla_surgery.surgery(
            compute_view(t.params), t.config, calib, qk_rope_head_dim=cfg.qk_rope_head_dim,
            method=cfg.surgery_method, latent_weight=cfg.latent_weight, **width)
        scfg = mla.MLAConfig.from_teacher(t.config, **dims)
        if cfg.kv_budget:
            ctx.say(f"surgery: per-layer latent ranks (CARE's greedy) {', '.join(map(str, scfg.kv_ranks))}; "
                    f"stored padded to kv_lora_rank {scfg.kv_lora_rank}")
    else:
        student, scfg, report = dba_surgery(ctx, calib)
    ctx.say("surgery: evaluating the teacher on the held-out windows")
    teacher_loss = heldout_loss(llama, t.params, t.config, ctx.data.heldout)
    kv_t, kv_s = llama.kv_bytes_per_token(t.config), module_of(scfg).kv_bytes_per_token(scfg)
    ctx.say(f"surgery: KV cache per token (bf16) teacher {kv_t:,} B, student {kv_s:,} B: {kv_t / kv_s:.2f}x smaller")
    report.update({"settings": surgery_settings(cfg), "teacher_loss": teacher_loss,
                   "teacher_perplexity": ppl(teacher_loss), "kv_bytes_per_token": {"teacher": kv_t, "student": kv_s,
                                                                                   "ratio": kv_t / kv_s},
                   "seconds": time.perf_counter() - start})
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "report.json", report)
    ckpt.save(path, {"params": student}, step=0,
              extra={**ctx.extra("surgery", scfg), "settings": surgery_settings(cfg), "report": report})
    ctx.say(f"surgery: teacher held-out loss {teacher_loss:.4f} (perplexity {ppl(teacher_loss):.2f}); {path}")
    return student, scfg


def dba_surgery(ctx: Context, calib: torch.Tensor) -> tuple:
    """``models.surgery.surgery`` at the recipe's dims, or with ``kv_budget`` at the per-layer widths its greedy
    draws (``models/kv_budget.py``)."""
    cfg, t = ctx.cfg, ctx.teacher
    width = (f"kv_budget {cfg.kv_budget} B" if cfg.kv_budget else f"sem_dim {cfg.sem_dim}")
    ctx.say(f"surgery: {cfg.surgery_method} on {calib.numel():,} calibration tokens (training split), {width}, "
            f"geo_dim {cfg.geo_dim}" + ("" if cfg.kv_budget else f", v_dim {cfg.v_dim}") + " per head"
            + (", one set of RoPE pairs for every layer and KV head (a plain Llama)" if cfg.rope_pairs_shared else ""))
    tc = t.config
    width = ({"dims_total": kv_budget.budget_dba_total(cfg.kv_budget, tc.n_layers, tc.n_kv_heads, cfg.geo_dim)}
             if cfg.kv_budget else {"sem_dim": cfg.sem_dim, "v_dim": cfg.v_dim})
    student, scfg, report = surgery.surgery(compute_view(t.params), tc, calib, geo_dim=cfg.geo_dim,
                                            method=cfg.surgery_method, shared_pairs=cfg.rope_pairs_shared, **width)
    if cfg.kv_budget:
        ctx.say(f"surgery: per-layer sem_dim (CARE's greedy) {', '.join(map(str, scfg.sem_dims))}; v_dim "
                f"{', '.join(map(str, scfg.v_dims))}; stored padded to sem_dim {scfg.sem_dim}, v_dim {scfg.v_dim}")
    return student, scfg, report


# ----------------------------------------------------------------------------------------------------------
# global fine-tune

def run_global(ctx: Context, student: dict, scfg) -> tuple[dict, str]:
    """Whole student, next-token CE (+ KD on the teacher's logits) through ``recipes.train.loop.Loop``; with
    ``global.orchestrator.enabled`` its strategies are scored on the student's CE on dev windows.
    Returns (params, stop reason: "" when finished)."""
    folder, cfg, g, t = ctx.folder / "global", ctx.cfg, ctx.cfg.global_phase, ctx.teacher
    if finished(ctx, "global", g.steps):
        return load_student(folder / FINAL, ctx.device)[0], ""
    tc, dist = global_train_config(cfg, str(folder)), ctx.dist
    run_setup = setup.start(tc, folder, student, device=ctx.device, dist=dist)
    layout = run_setup.layout
    student = layout.full_shapes() if layout else student   # fsdp: only the shards stay alive
    state, loop, resume = run_setup.state, run_setup.loop, run_setup.resume
    kd = g.kd_alpha > 0
    module = module_of(scfg)

    def loss_fn(params, batch, frozen=None, layers=None):
        if not kd:
            return module.loss(params, batch, scfg, remat=tc.remat, layers=layers)
        logits = module.apply(params, batch["x"], scfg, remat=tc.remat, layers=layers)
        with torch.no_grad():   # the step's layers: its compiled block; the student's layers alone are its own
            teacher_logits = llama.apply(frozen, batch["x"], t.config, layers=layers)
        return losses.distill_objective(logits, batch["y"], teacher_logits, alpha=g.kd_alpha,
                                        temperature=g.temperature)

    batches = ctx.data.corpus.batches(g.batch_size, cfg.block_size, cfg.seed + 1, grad_accum=g.grad_accum,
                                 device=ctx.device, rank=dist.rank, world_size=dist.world_size)
    dev = EvalBatches(ctx.data.dev, g.batch_size * dist.world_size, cfg.block_size, g.eval_batches, device=ctx.device)
    vocab = ctx.data.corpus.tokenizer.vocab_size
    steps = build_steps(tc, loss_fn, run_setup.optimizer, student, batches, ctx.device, vocab, dist, layout)
    # validation and the orchestrator's probe: the student's next-token CE (the training loss adds KD)
    student_ce = make_eval_step(lambda prm, b, layers=None: module.loss(prm, b, scfg, layers=layers), precision=tc.dtype,
                                shard=layout)
    extra = ctx.extra("global", scfg)
    with run_setup.writing(to_dict(cfg)) as (manager, logger):
        ctx.say(f"global: {g.steps} steps of {g.batch_size * g.grad_accum} x {cfg.block_size} tokens, "
                + (f"KD alpha {g.kd_alpha} at T={g.temperature} + CE" if kd else "next-token CE")
                + (f"; resuming from {resume} at step {int(state.step)}" if resume else ""))
        orchestrator, steps = orchestrate(   # strategies are scored on the student's CE on held-out windows
            tc, steps, make_step=lambda opt: build_steps(tc, loss_fn, opt, student, batches, ctx.device, vocab).train,
            val_tokens=ctx.data.dev, device=ctx.device, logger=logger, folder=folder, resumed=run_setup.resumed,
            eval_step=student_ce)
        frozen = t.params if kd else None
        with Loop(tc, state, steps, logger, manager, counters=loop, frozen=frozen, hooks=[orchestrator],
                  validation=Validation(lambda p: evaluate(student_ce, p, dev, dist=dist)),
                  measures=Measures(tokens_per_step=g.batch_size * g.grad_accum * cfg.block_size * dist.world_size),
                  extra=lambda: extra, resume_folder=ctx.folder, dist=dist) as training:
            for batch in training:
                training.stepped(*steps.train(training.state, batch, frozen))
        result = training.result
    params = (layout.gather_state(result.state) if layout else result.state).params
    if result.stop_reason and not (folder / FINAL).exists():
        return params, f"global: {result.stop_reason}"
    return params, ""


# ----------------------------------------------------------------------------------------------------------
# verify

@torch.no_grad()
def compare(ctx: Context, student: dict, scfg, windows: EvalBatches) -> dict:
    """Per-layer attention-output L1 (both attentions on the teacher's block inputs) and logit L1, per window;
    mean and max over windows, plus the teacher's mean |value| for scale."""
    t, wide = ctx.teacher, student["embed"].dtype     # a bf16-held teacher is compared in the student's dtype
    attn, attn_scale, logit, logit_scale = [], [], [], []
    for batch in windows:
        logits_t, hidden = llama.apply(t.params, batch["x"], t.config, return_hidden=True)
        inputs = torch.stack(hidden[:-1])
        a_t = blockwise.attention_outputs(t.params, t.config, inputs).to(wide)
        a_s = blockwise.attention_outputs(student, scfg, inputs.to(wide))
        logits_t = logits_t.to(wide)
        attn.append((a_s - a_t).abs().flatten(1).mean(1))
        attn_scale.append(a_t.abs().flatten(1).mean(1))
        logit.append((module_of(scfg).apply(student, batch["x"], scfg) - logits_t).abs().mean())
        logit_scale.append(logits_t.abs().mean())
    attn, attn_scale = torch.stack(attn), torch.stack(attn_scale)          # [windows, L]
    logit, logit_scale = torch.stack(logit), torch.stack(logit_scale)
    return {"attention": {"mean_l1": attn.mean(0).tolist(), "max_l1": attn.amax(0).tolist(),
                          "teacher_mean_abs": attn_scale.mean(0).tolist()},
            "logits": {"mean_l1": logit.mean().item(), "max_l1": logit.amax().item(),
                       "teacher_mean_abs": logit_scale.mean().item()}}


def violations(stats: dict, vc) -> list[str]:
    """One line per violated threshold, the worst layer first for the attention."""
    out = []
    for kind in ("mean", "max"):
        limit = getattr(vc.attention, f"max_{kind}_l1")
        if limit is not None:
            values = stats["attention"][f"{kind}_l1"]
            bad = sorted((v, i) for i, v in enumerate(values) if v > limit)
            if bad:
                v, i = bad[-1]
                out.append(f"layer {i} attention {kind} L1 {v:.4g} > verify.attention.max_{kind}_l1={limit:g}"
                           + (f" ({len(bad)} layers over)" if len(bad) > 1 else ""))
        limit = getattr(vc.logits, f"max_{kind}_l1")
        if limit is not None and stats["logits"][f"{kind}_l1"] > limit:
            out.append(f"logits {kind} L1 {stats['logits'][f'{kind}_l1']:.4g} > verify.logits.max_{kind}_l1={limit:g}")
    return out


def run_verify(ctx: Context, student: dict, scfg, label: str) -> dict:
    """Compare on held-out windows, write ``verify/report.json``, then fail or warn on violated thresholds.
    A rerun reuses the stored numbers for the same student checkpoint (``label``, a path under the run folder,
    and its size and mtime) and re-applies the current thresholds."""
    vc, path = ctx.cfg.verify, ctx.folder / "verify" / "report.json"
    windows = EvalBatches(ctx.data.heldout.tokens, 1, ctx.cfg.block_size, vc.windows, device=ctx.device)
    stat = (ctx.folder / label).stat()
    student_id = f"{stat.st_size}-{stat.st_mtime_ns}"
    stored = json.loads(path.read_text()) if path.exists() else None
    if stored and stored.get("student_id") == student_id and stored.get("windows") == vc.windows:
        stats = {"attention": stored["attention"], "logits": stored["logits"]}
        ctx.say(f"verify: reusing the comparison in {path}")
    else:
        ctx.say(f"verify: comparing teacher and student ({label}) on {vc.windows} held-out windows")
        stats = compare(ctx, student, scfg, windows)
    problems = violations(stats, vc)
    report = {"student": label, "student_id": student_id, "windows": vc.windows, "block_size": ctx.cfg.block_size,
              **stats, "thresholds": to_dict(vc), "violations": problems, "passed": not problems}
    write_json(path, report)
    a = stats["attention"]
    worst = max(range(len(a["mean_l1"])), key=lambda i: a["mean_l1"][i])
    ctx.say(f"verify: attention mean L1 {sum(a['mean_l1']) / len(a['mean_l1']):.4g} over layers (worst layer "
            f"{worst}: {a['mean_l1'][worst]:.4g}, teacher |attn| {a['teacher_mean_abs'][worst]:.4g}); logits mean L1 "
            f"{stats['logits']['mean_l1']:.4g} (teacher |logit| {stats['logits']['teacher_mean_abs']:.4g}); {path}")
    if problems:
        message = f"verify failed: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "") \
            + f"; report {path}"
        if vc.on_fail == "fail":
            raise UserError(message)
        ctx.say(f"warning: {message} (verify.on_fail=warn: continuing)")
    return report
