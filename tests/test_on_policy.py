"""On-policy distillation (GKD's ``lmbda``: ``recipe=distill on_policy=``): the student's continuation of a row is
its own KV-cache decode, token for token what ``recipe=generate`` prints for the same params, prompt, seed and
temperature; the batch the step sees (prompt kept, CE only on real text, the KL on the student's tokens); the
rollout a pure function of (seed, cursor, rank). The compiled runs, one process and 2 torchrun ranks, are the default
path's (tests/test_default_paths.py: docs/distill.md's ``kl=jsd beta=0.5 on_policy=0.5`` command, and the same on 2
ranks, whose compile it shares)."""
from pathlib import Path

import torch

from purestep.core.io import checkpoint as ckpt
from purestep.models import losses
from purestep.models.loading import model_entry
from purestep.recipes import generate
from purestep.recipes import main

REPO = Path(__file__).resolve().parent.parent
TINY = ["block_size=16", "batch_size=4", "sample_tokens=0", "save_every=0", "eval_batches=1", "eval_every=0",
        "warmup_steps=1", "log_every=1", "model.d_model=16", "model.n_layers=1", "model.n_heads=2"]


def prepared(teacher, data, *extra):
    from purestep.core.config import resolve
    from purestep.recipes.distill import recipe
    overrides = dict(a.split("=", 1) for a in [f"teacher={teacher}", f"data={data}", *TINY, "compile=false", *extra])
    return recipe.prepare_run(resolve(recipe.Config, overrides=overrides), None)


def test_a_rolled_out_row_is_what_recipe_generate_writes(tiny_teacher, token_cache, tmp_path, capsys):
    teacher, data = tiny_teacher
    from purestep.recipes.distill import recipe
    p = prepared(teacher, data, "on_policy=0.5", "on_policy_prompt=5", "on_policy_temperature=0.8", "seed=3")
    rollout, params, cursor = recipe.rollout(p), p.run.state.params, 2
    batches, tok = recipe.train_steps(p, p.run.optimizer).batches, p.data.corpus.tokenizer
    batch = batches.get(cursor)
    out = rollout(params, batch)
    rows = rollout.chosen(cursor, 4)
    assert 0 < len(rows) < 4, rows           # this seed and cursor: some rows on-policy, some not
    assert rows == rollout.chosen(cursor, 4) and torch.equal(out["x"], rollout(params, batch)["x"])   # pure
    x, y, kd = out["x"], out["y"], out["kd_mask"]
    for r in range(4):
        if r not in rows:                    # off-policy rows as the data gave them, the KL where the CE is
            assert torch.equal(x[r], batch["x"][r]) and torch.equal(y[r], batch["y"][r]) and kd[r].all()
            continue
        assert torch.equal(x[r, :5], batch["x"][r, :5]) and not torch.equal(x[r, 5:], batch["x"][r, 5:])
        assert torch.equal(y[r, :4], batch["y"][r, :4]) and (y[r, 4:] == losses.IGNORE_INDEX).all()
        assert kd[r].all()                   # the char tokenizer has no EOS: every position of the row
    # the student as a checkpoint, and recipe=generate on each rolled-out row's prompt with that row's seed
    student = tmp_path / "student.msgpack"
    ckpt.save(student, {"params": params}, step=0,
              extra={"model": model_entry(p.student), "tokenizer": tok.to_dict()})
    for r in rows:
        prompt = tok.decode(batch["x"][r, :5].tolist())
        capsys.readouterr()
        text = generate.run(generate.Config(init=str(student), prompt=prompt, max_new_tokens=11, temperature=0.8,
                                            seed=rollout.row_seed(cursor, r)))
        assert text == tok.decode(x[r].tolist()), (r, text)
    # another cursor draws other rows or other tokens
    other = rollout(params, batches.get(cursor + 1))
    assert rollout.row_seed(cursor + 1, rows[0]) != rollout.row_seed(cursor, rows[0])
    assert not torch.equal(other["x"], out["x"])


def test_the_rollout_stops_at_eos_and_the_kl_stops_with_it():
    """With an EOS in the vocabulary the KL counts an on-policy row's positions up to the one that predicts the first
    EOS it wrote (TRL masks after the first EOS), and the CE none of its generated positions."""
    from purestep.models import llama
    from purestep.recipes.distill.on_policy import OnPolicy
    cfg = llama.LlamaConfig(vocab_size=6, d_model=8, n_layers=1, n_heads=2, init_std=0.1)   # near uniform: EOS often drawn
    params = llama.init(cfg, 0)
    rollout = OnPolicy(1.0, 3, 1.0, 0, 0, cfg, eos_id=5, precision="fp32")
    x = torch.randint(0, 5, (8, 12), generator=torch.Generator().manual_seed(1))
    out = rollout(params, {"x": x, "y": torch.roll(x, -1, 1), "step": torch.tensor(4)})
    written = out["x"][:, 3:]
    stops = 0
    for r in range(8):
        eos = (written[r] == 5).nonzero().flatten().tolist()
        last = 2 + (eos[0] + 1 if eos else written.shape[1] + 1)        # the KL's last position, exclusive
        assert out["kd_mask"][r].tolist() == [True] * last + [False] * (12 - last), (r, written[r])
        assert (out["y"][r, 2:] == losses.IGNORE_INDEX).all() and torch.equal(out["y"][r, :2], x[r, 1:3])
        stops += bool(eos)
    assert 0 < stops < 8      # some rows stopped at EOS, some wrote to the end of the window


def test_resume_rolls_out_what_the_straight_run_did(tiny_teacher, token_cache, tmp_path):
    """The rollouts are a function of (seed, cursor, rank) and the params: 2 steps, then resumed to 4, end bitwise where
    4 straight steps end (with micro-batches: the rows of both are rolled out)."""
    from purestep.core.tree import tree_leaves
    teacher, data = tiny_teacher
    common = ["recipe=distill", f"teacher={teacher}", f"data={data}", *TINY, "compile=false", "on_policy=0.5",
              "grad_accum=2", "decay_steps=4"]
    for out, steps in (("a", 2), ("a", 4), ("b", 4)):
        assert main([*common, f"steps={steps}", f"out={tmp_path / out}"]) == 0
    a, b = (ckpt.load(tmp_path / x / "final.msgpack") for x in "ab")
    assert a["step"] == b["step"] == 4
    assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a["state"]), tree_leaves(b["state"])))


def test_bad_on_policy_keys_are_refused(tiny_teacher, token_cache, tmp_path, capsys):
    teacher, data = tiny_teacher
    base = ["recipe=distill", f"teacher={teacher}", f"data={data}", *TINY, "compile=false", f"out={tmp_path / 'x'}"]
    assert main([*base, "on_policy=0.5", "on_policy_prompt=16"]) == 2
    assert "on_policy_prompt" in capsys.readouterr().err
    assert main([*base, "on_policy=1.5"]) == 2
    assert "on_policy" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_policy_bench_scores_a_student_on_its_own_samples_and_on_the_data(tiny_teacher, token_cache, tmp_path,
                                                                               capsys):
    """``recipe=bench.policy`` (the on/off-policy table): the teacher as its own student has KL 0 on both its samples
    and the data, the teacher's NLL of its samples is its own, and its CE on the data is its val loss there; a
    distilled student of another shape has KL > 0."""
    import math
    import re
    from purestep.recipes.bench import policy
    teacher, data = tiny_teacher
    assert main(["recipe=distill", f"teacher={teacher}", f"data={data}", f"out={tmp_path / 'student'}", *TINY,
                 "steps=2", "compile=false"]) == 0
    table = policy.run(policy.Config(teacher=str(teacher), students=f"{teacher},{tmp_path / 'student'}",
                                     data=str(data), windows=4, prompt=6, new_tokens=8, out=str(tmp_path / "t.md")))
    rows = [[float(v) for v in re.findall(r"\| ([\d.]+)", line)] for line in table.splitlines()[2:]]
    (kl_own, nll_own, kl_data, ce_data), other = rows
    assert abs(kl_own) < 1e-5 and abs(kl_data) < 1e-5 and 0 < nll_own < math.log(256) and 0 < ce_data
    assert other[0] > 1e-3 and other[2] > 1e-3
    assert (tmp_path / "t.md").read_text() == table + "\n"
