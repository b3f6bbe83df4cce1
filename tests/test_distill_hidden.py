"""Hidden-state targets (``recipe=distill hidden=s:t``, ``recipes.distill.hidden``): the term equals a float64 hand
formula (MSE and cosine, through the learned projection where the widths differ, the identity where they agree),
it trains with the student and stays out of it, and bad pairs or a cache are refused naming the key. As users run
it, compiled, it is tests/test_default_paths.py's ``test_distill_hidden_targets``."""
import pytest
import torch

from purestep.core.config import resolve
from purestep.models import llama, losses
from purestep.models.loading import load_model
from purestep.recipes import main
from purestep.recipes.distill import hidden as hidden_targets, objective, recipe
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

TINY = ["block_size=16", "batch_size=4", "sample_tokens=0", "save_every=0", "eval_batches=1", "eval_every=0",
        "warmup_steps=1", "log_every=1", "model.n_layers=2", "model.n_heads=2", "compile=false"]


def prepared(teacher, data, *extra):
    overrides = dict(a.split("=", 1) for a in [f"teacher={teacher}", f"data={data}", *TINY, *extra])
    return recipe.prepare_run(resolve(recipe.Config, overrides=overrides), None)


def hand_term(student_h, teacher_h, w, kind, mask):
    s = student_h.double() if w is None else student_h.double() @ w.double()
    t = teacher_h.double()
    per = (s - t).square().mean(-1) if kind == "mse" else 1 - (s * t).sum(-1) / (s.norm(dim=-1) * t.norm(dim=-1))
    return float(per[mask].mean())


@pytest.mark.parametrize("kind,width", [("mse", 16), ("cosine", 16), ("mse", 32)])
def test_the_hidden_term_equals_the_hand_formula(kind, width, tiny_teacher, token_cache):
    teacher, data = tiny_teacher
    p = prepared(teacher, data, f"model.d_model={width}", "hidden=1:1,2:0", f"hidden_loss={kind}",
                 "hidden_weight=0.7")
    params, tparams, tcfg = p.run.state.params, p.teacher.model.params, p.teacher.model.config
    assert (hidden_targets.PROJ in params) == (width != 32)              # the teacher is d=32
    pairs = hidden_targets.pairs("1:1,2:0", p.student, tcfg)
    loss_fn = objective.make_loss(p.cfg, p.student, tcfg, "", pairs)
    batch = recipe.train_steps(p, p.run.optimizer).batches.get(0)
    loss, aux = loss_fn(params, batch, None, {"teacher": tparams})
    logits, states = llama.apply(params, batch["x"], p.student, return_hidden=True)
    teacher_logits, teacher_states = llama.apply(tparams, batch["x"], tcfg, return_hidden=True)
    mask = batch["y"] >= 0
    proj = params.get(hidden_targets.PROJ, {})
    expected = sum(hand_term(states[s], teacher_states[t], proj.get(f"{s}:{t}"), kind, mask)
                   for s, t in pairs) / 2
    assert aux["hidden"].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    kd, _ = losses.distill_objective(logits, batch["y"], teacher_logits, alpha=p.cfg.alpha)
    assert loss.item() == pytest.approx(kd.item() + 0.7 * expected, rel=1e-5)


def test_hidden_targets_train_the_projection_and_stay_out_of_the_student(tiny_teacher, token_cache, tmp_path):
    teacher, data = tiny_teacher
    out = tmp_path / "run"
    assert main(["recipe=distill", f"teacher={teacher}", f"data={data}", f"out={out}", *TINY, "model.d_model=16",
                 "hidden=2:1", "hidden_weight=1000", "steps=6", "lr=1e-2"]) == 0
    import json
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    hidden = [r["hidden"] for r in rows if "hidden" in r]
    assert len(hidden) == 6 and hidden[-1] < 0.5 * hidden[0], hidden
    student = load_model(str(out / "final.msgpack"))                    # a model: the projection is there, unread
    assert student.config.d_model == 16
    again = tmp_path / "again"                                          # init= from it: the student alone
    assert main(["recipe=distill", f"teacher={teacher}", f"data={data}", f"out={again}", *TINY[:-3],
                 "compile=false", f"init={out}", "steps=2"]) == 0


@pytest.mark.parametrize("args,needle", [
    (["hidden=3:1"], "the student has states 0 to 2"),
    (["hidden=1-1"], "student:teacher layer pairs"),
    (["hidden=1:1,1:1"], "names a pair twice"),
    (["hidden=1:1", "hidden_loss=l2"], "hidden_loss"),
])
def test_bad_hidden_keys_are_one_line(args, needle, tiny_teacher, token_cache, tmp_path, capsys):
    teacher, data = tiny_teacher
    code = main(["recipe=distill", f"teacher={teacher}", f"data={data}", f"out={tmp_path / 'x'}", *TINY, *args])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "x").exists()


def test_a_cache_cannot_give_hidden_targets(tiny_teacher, token_cache, tmp_path, capsys):
    teacher, data = tiny_teacher
    assert main(["recipe=distill_cache", f"teacher={teacher}", f"data={data}", "steps=2", "block_size=16",
                 "batch_size=4", f"out={tmp_path / 'cache'}", "k=4"]) == 0
    capsys.readouterr()
    assert main(["recipe=distill", f"teacher={teacher}", f"data={data}", f"out={tmp_path / 'x'}", *TINY, "steps=2",
                 f"cache={tmp_path / 'cache'}", "hidden=1:1"]) == 2
    err = capsys.readouterr().err
    assert "hidden=1:1 with cache=" in err and "hidden states" in err


def test_two_sharded_ranks_equal_one_process_with_a_projection(tiny_teacher, token_cache, tmp_path):
    """parallel=fsdp shards the projection like any leaf: 2 ranks x 4 rows equal 1 process x 8 rows."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from purestep.core.io import checkpoint as ckpt
    from purestep.core.tree import max_abs_diff
    teacher, data = tiny_teacher
    common = ["recipe=distill", f"teacher={teacher}", f"data={data}", *TINY, "model.d_model=16", "hidden=1:1,2:1",
              "steps=3"]
    assert main([*common, "batch_size=8", f"out={tmp_path / 'one'}"]) == 0
    bin_run = Path(__file__).resolve().parent.parent / "bin" / "run"
    torchrun = Path(sys.executable).parent / "torchrun"
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    proc = subprocess.run([*launcher, "--standalone", "--nproc_per_node=2", str(bin_run),
                           *merge_args(*common, "parallel=fsdp",
                           f"out={tmp_path / 'two'}")], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = (ckpt.load(tmp_path / name / "final.msgpack") for name in ("one", "two"))
    assert set(one["state"]["params"][hidden_targets.PROJ]) == {"1:1", "2:1"}
    assert max_abs_diff(one["state"]["params"], two["state"]["params"]) < 1e-6
    assert abs(one["val_loss"] - two["val_loss"]) < 1e-6
