"""``teacher_dtype=auto|fp32|bf16`` for frozen teachers (``recipes/distill/teacher.py``): the resolution rule,
``auto`` on a CPU holding a purestep teacher exactly as before (fp32, bitwise), and a bf16 teacher running
distill (online and from a cache), upcycle and compress end to end with losses close to the fp32 teacher's."""
import csv
import json
import math
from pathlib import Path

import pytest
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.tree import tree_leaves
from purestep.models.loading import load_model
from purestep.recipes import main
from purestep.recipes.distill.teacher import held_dtype_hint, load_teacher, resolve_teacher_dtype

pytestmark = pytest.mark.usefixtures("token_cache")   # tests/conftest.py

COMMON = ["block_size=32", "batch_size=16", "compile=false", "sample_tokens=0", "save_every=0", "log_every=10"]
STUDENT = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "lr=3e-3", "min_lr=3e-4"]
KD_STEPS = ["steps=40", "warmup_steps=4", "eval_every=0", "eval_batches=8"]
# Measured on this CPU, bf16 teacher against fp32 (same student, same batches): distill val loss 3.2068 vs 3.2069
# online and 3.1720 vs 3.1721 from a top-8 cache; upcycle held-out loss within 0.0003 (0.01%) after every phase;
# compress explained variance within 1e-5. 1% leaves room for other CPUs and thread counts.
REL_TOL = 0.01


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory):
    """A tiny GQA Llama (4 query / 2 KV heads of 16) trained briefly by recipe=standard: a purestep checkpoint."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    assert main(["recipe=standard", f"data={corpus}", f"out={out}", "model.d_model=64", "model.n_layers=2",
                 "model.n_heads=4", "model.n_kv_heads=2", "block_size=32", "batch_size=16", "steps=60", "lr=3e-3",
                 "warmup_steps=5", "eval_every=0", "sample_tokens=0", "compile=false", "log_every=30"]) == 0
    return out


def final_val(out) -> float:
    return ckpt.load(Path(out) / "final.msgpack")["loop"]["best_val"]


def close(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= REL_TOL * abs(b)


def test_resolution_rule():
    """auto: bf16 on CUDA whatever is stored; elsewhere the stored dtype, half types widened to fp32."""
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    assert resolve_teacher_dtype("auto", "cuda", f32) == bf16
    assert resolve_teacher_dtype("auto", "cuda", f16) == bf16
    assert resolve_teacher_dtype("auto", "cpu", f32) == f32
    assert resolve_teacher_dtype("auto", "cpu", f64) == f64
    assert resolve_teacher_dtype("auto", "cpu", bf16) == f32        # no native bf16 matmul: widened, as before
    assert resolve_teacher_dtype("auto", "mps", f16) == f32
    assert resolve_teacher_dtype("fp32", "cuda", bf16) == f32
    assert resolve_teacher_dtype("bf16", "cpu", f32) == bf16


def test_auto_on_a_cpu_is_the_fp32_teacher_bitwise(teacher):
    auto = load_teacher(str(teacher), torch.device("cpu"))
    before = load_model(str(teacher), device=torch.device("cpu"))       # what every recipe loaded until now
    assert all(t.dtype == torch.float32 for t in tree_leaves(auto.params))
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(auto.params), tree_leaves(before.params)))
    held = load_teacher(str(teacher), torch.device("cpu"), "bf16")
    assert all(t.dtype == torch.bfloat16 for t in tree_leaves(held.params))


def test_distill_online_and_cached_with_a_bf16_teacher(corpus, teacher, tmp_path, capsys):
    def distill(out, *extra):
        assert main(["recipe=distill", f"data={corpus}", f"teacher={teacher}", f"out={out}", *COMMON, *STUDENT,
                     *KD_STEPS, *extra]) == 0
        return final_val(out)

    def cache(out, *extra):
        assert main(["recipe=distill_cache", f"data={corpus}", f"teacher={teacher}", f"out={out}", *COMMON[:2],
                     "mode=topk", "k=8", "steps=40", *extra]) == 0
        return out

    fp32, bf16 = distill(tmp_path / "fp32"), distill(tmp_path / "bf16", "teacher_dtype=bf16")
    c32, c16 = cache(tmp_path / "c32"), cache(tmp_path / "c16", "teacher_dtype=bf16")
    assert json.loads((c16 / "meta.json").read_text())["teacher"]["dtype"] == "bfloat16"
    cached32 = distill(tmp_path / "cached32", f"cache={c32}")
    cached16 = distill(tmp_path / "cached16", f"cache={c16}", "teacher_dtype=bf16")
    with capsys.disabled():
        print(f"online: fp32 {fp32:.4f}, bf16 {bf16:.4f}; topk cache: fp32 {cached32:.4f}, bf16 {cached16:.4f}")
    assert fp32 != bf16 and close(bf16, fp32) and close(cached16, cached32)
    # a bf16 teacher's cache read by an fp32 teacher's run is refused, saying why
    capsys.readouterr()
    assert main(["recipe=distill", f"data={corpus}", f"teacher={teacher}", f"out={tmp_path / 'mixed'}", *COMMON,
                 *STUDENT, *KD_STEPS, f"cache={c16}"]) == 2
    err = capsys.readouterr().err
    assert "held in bfloat16 (teacher_dtype=bf16) there, in float32 here" in err, err


def test_resuming_with_another_teacher_dtype_is_refused_by_name(corpus, teacher, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["recipe=distill", f"data={corpus}", f"teacher={teacher}", f"out={out}", *COMMON, *STUDENT, "eval_every=0"]
    assert main([*args, "steps=4", "warmup_steps=1", "teacher_dtype=bf16"]) == 0
    capsys.readouterr()
    assert main([*args, "steps=8", "warmup_steps=1"]) == 2
    err = capsys.readouterr().err
    assert "held in bfloat16 (teacher_dtype=bf16) there, in float32 here" in err, err


def test_a_dtype_change_is_named():
    old = {"source": "t", "fingerprint": "a", "dtype": "bfloat16"}
    assert held_dtype_hint(old, {"source": "t", "fingerprint": "b", "dtype": "float32"}) == \
        "held in bfloat16 (teacher_dtype=bf16) there, in float32 here"
    assert held_dtype_hint(old, {"source": "other", "fingerprint": "b", "dtype": "float32"}) == ""
    assert held_dtype_hint({"source": "t", "fingerprint": "a"}, {"source": "t", "dtype": "float32"}) == ""


def test_upcycle_ci_size_with_a_bf16_teacher(corpus, teacher, tmp_path):
    """Surgery widens the bf16 teacher to fp32 (the student stays fp32); blockwise, global (KD), verify and the
    benchmark run against it."""
    dims = ["sem_dim=2", "geo_dim=6", "v_dim=8", "blockwise.steps=20", "global.steps=20",
            "blockwise.cache_teacher=true", "verify.attention.max_mean_l1=10", "verify.logits.max_mean_l1=100"]
    stages = {}
    for dtype in ("fp32", "bf16"):
        out = tmp_path / dtype
        assert main(["recipe=upcycle", "preset=ci", f"teacher={teacher}", f"data={corpus}", f"out={out}", *dims,
                     f"teacher_dtype={dtype}"]) == 0
        stages[dtype] = {p: json.loads((out / p / "heldout.json").read_text())["loss"]
                         for p in ("surgery", "blockwise", "global")}
        student = ckpt.load(out / "global" / "final.msgpack")["state"]["params"]
        assert all(t.dtype == torch.float32 for t in tree_leaves(student))
        assert json.loads((out / "verify" / "report.json").read_text())["passed"]
        assert json.loads((out / "benchmark" / "results.json").read_text())["teacher"]["decode_ms_per_token"] > 0
    print(stages)
    assert all(close(stages["bf16"][p], stages["fp32"][p]) for p in stages["fp32"]), stages


def test_compress_with_a_bf16_teacher(corpus, teacher, tmp_path):
    """The bf16 teacher's states are widened to fp32 for PCA's moments and the compressor."""
    def run(out, *extra):
        assert main(["recipe=compress", f"teacher={teacher}", f"data={corpus}", f"out={out}", "d_compressed=16",
                     "steps=30", "block_size=16", "batch_size=8", "train_tokens=1024", "val_tokens=256",
                     "warmup_steps=5", "log_every=10", *extra]) == 0
        with open(out / "summary.csv", newline="") as f:
            return next(csv.DictReader(f))

    fp32, bf16 = run(tmp_path / "fp32"), run(tmp_path / "bf16", "teacher_dtype=bf16")
    print({k: (fp32[k], bf16[k]) for k in ("pca_explained_variance", "explained_variance")})
    for key in ("pca_explained_variance", "explained_variance"):
        assert close(float(bf16[key]), float(fp32[key])), (key, fp32[key], bf16[key])
