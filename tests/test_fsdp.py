"""parallel=fsdp (core.parallel.shard): 2 gloo ranks under torchrun against one process, checkpoints across rank counts,
the layout's cut and join, the sharded step traced as one graph, and the refusals."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from purestep.core.io import checkpoint as ckpt
from purestep.core.parallel.distributed import cpu_tensor_parallel_refusal
from purestep.core.parallel.shard import Layout
from purestep.core.tree import max_abs_diff, tree_leaves, tree_map
from purestep.models import llama
from purestep.optim.health import stacked_predicate
from purestep.recipes import main
from purestep.recipes.train.optimizer import AdaGCConfig, OptimizerSpec, make_optimizer
from purestep.core.step import Compile, Gradients, Parallel
from purestep.core.update import Monitors
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

REPO = Path(__file__).resolve().parent.parent
TINY = ["recipe=standard", "preset=tiny", "compile=false", "sample_tokens=0", "log_every=5", "eval_every=10",
        "steps=20", "save_every=10", "keep_last=0", "clipping=adagc", "adagc.warmup=5", "health=true"]

pytestmark = pytest.mark.usefixtures("token_cache")   # corpus and token_cache: tests/conftest.py


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def torchrun(args, cwd, timeout=300, ranks=2):
    return subprocess.run(["torchrun", "--standalone", f"--nproc_per_node={ranks}", str(REPO / "bin" / "run"),
                           *merge_args(*args)],
                          cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def equal(a, b) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def test_two_sharded_ranks_equal_one_process_and_checkpoints_move_between_rank_counts(corpus, tmp_path, one_thread):
    common = [*TINY, f"data={corpus}", "grad_accum=2"]     # micro-batches summed, reduce-scattered once per step
    assert main([*common, "batch_size=8", f"out={tmp_path / 'one'}"]) == 0
    two = torchrun([*common, "batch_size=4", "parallel=fsdp", f"out={tmp_path / 'two'}"], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    one_ck, two_ck = (ckpt.load(tmp_path / n / "final.msgpack") for n in ("one", "two"))
    assert max_abs_diff(one_ck["state"]["params"], two_ck["state"]["params"]) < 1e-6
    assert abs(one_ck["val_loss"] - two_ck["val_loss"]) < 1e-6
    assert "parallel: fsdp over 2 ranks" in two.stderr and "stacked leaves gathered per block" in two.stderr
    ratios = [float(r) for r in re.findall(r"rank \d ([\d.]+) MiB \(([\d.]+)x\)", two.stderr) for r in r[1:]]
    assert len(ratios) == 2 and max(ratios) <= 0.55, two.stderr[-2000:]
    losses = [_losses(tmp_path / n / "metrics.jsonl") for n in ("one", "two")]
    assert losses[0].keys() == losses[1].keys() and max(abs(losses[0][k] - losses[1][k]) for k in losses[0]) < 1e-6

    # the step-10 checkpoint of the 2-rank run loads bitwise, every leaf (params, moments, step counters, key,
    # cursor, spike monitor): on 1 process as it is, on 2 ranks as their shards joined (what a gather returns)
    saved = tmp_path / "two" / "step_000000010.msgpack"
    on_file = ckpt.load(saved)["state"]
    assert int(on_file["step"]) == 10
    for world in (1, 2):
        assert _unequal_named(_loaded_state(common, saved, world), on_file) == [], world

    # it continues on 2 ranks bitwise, and on 1 process within 1e-6
    for name in ("again2", "again1"):
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "two" / "step_000000010.msgpack", tmp_path / name)
    again2 = torchrun([*common, "batch_size=4", "parallel=fsdp", f"out={tmp_path / 'again2'}"], tmp_path)
    assert again2.returncode == 0, again2.stderr[-3000:]
    assert "resuming from" in again2.stderr
    assert main([*common, "batch_size=8", "parallel=none", f"out={tmp_path / 'again1'}"]) == 0
    again2_ck, again1_ck = (ckpt.load(tmp_path / n / "final.msgpack") for n in ("again2", "again1"))
    assert equal(again2_ck["state"], two_ck["state"])
    assert max_abs_diff(again1_ck["state"]["params"], two_ck["state"]["params"]) < 1e-6


def test_sharded_checkpoints_are_written_by_every_rank_and_resume_on_any(corpus, tmp_path, one_thread, capsys):
    """``checkpoint_shards=true`` on 2 fsdp ranks: each checkpoint is rank 0's index and one file of pieces per rank;
    the step-10 index loads to every leaf of the state bit for bit as the ranks' shards joined (what a gather to rank
    0 writes in the one-file format); copied away (the index and its pieces) it resumes in one process to the 2-rank
    run's end (1e-6); an index one of whose pieces is gone is skipped by discovery, naming the piece."""
    common = [*TINY, f"data={corpus}"]
    run = torchrun([*common, "batch_size=4", "parallel=fsdp", "checkpoint_shards=true", f"out={tmp_path / 'shards'}"],
                   tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    folder = tmp_path / "shards"
    for step in (10, 20):
        assert sorted(p.name for p in folder.glob(f"step_{step:09d}*")) == [
            f"step_{step:09d}.msgpack", *(f"step_{step:09d}.shard-{i:05d}-of-00002.msgpack" for i in range(2))]
    saved = folder / "step_000000010.msgpack"
    assert _unequal_named(_loaded_state(common, saved, 2), ckpt.load(saved)["state"]) == []
    (tmp_path / "again").mkdir()
    for piece in folder.glob("step_000000010*"):
        shutil.copy(piece, tmp_path / "again")
    assert main([*TINY, f"data={corpus}", "batch_size=8", f"out={tmp_path / 'again'}"]) == 0
    again, two = (ckpt.load(tmp_path / n / "final.msgpack") for n in ("again", "shards"))
    assert max_abs_diff(again["state"]["params"], two["state"]["params"]) < 1e-6
    gone = folder / "step_000000020.shard-00001-of-00002.msgpack"
    gone.unlink()
    capsys.readouterr()
    assert ckpt.latest(folder) == folder / "step_000000010.msgpack"
    assert f"{gone}: a shard of this checkpoint is missing" in capsys.readouterr().err


def test_sharded_bf16_equals_one_process_to_bf16_rounding(corpus, tmp_path, one_thread):
    """dtype=bf16: the 2 ranks run the model on params gathered in bf16 (FSDP2's param_dtype; the layers come gathered
    in bf16 in the eager per-block test below), one process on fp32 params under autocast; both update fp32
    master weights. After 10 steps: the params within 1e-3 (a few Adam steps of lr 1e-3 that round the other way),
    the validation loss within 2e-2 (a bf16 ulp at 4)."""
    common = [*TINY, f"data={corpus}", "dtype=bf16", "steps=10", "save_every=0", "eval_batches=4"]
    assert main([*common, "batch_size=8", f"out={tmp_path / 'one'}"]) == 0
    two = torchrun([*common, "batch_size=4", "parallel=fsdp", f"out={tmp_path / 'two'}"], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    one_ck, two_ck = (ckpt.load(tmp_path / n / "final.msgpack") for n in ("one", "two"))
    assert 0 < _diff(one_ck["state"]["params"], two_ck["state"]["params"]) < 1e-3
    assert abs(one_ck["val_loss"] - two_ck["val_loss"]) < 2e-2


def _loaded_state(args: list, path: Path, world: int) -> dict:
    """The train state a ``recipe=standard`` run of ``args`` resumes from the checkpoint ``path`` on ``world`` ranks,
    each rank's load run in this process (``recipes.train.setup.start``: the file read, then this rank's cut), the
    ranks' shards joined as ``core.parallel.shard.Layout.gather_state`` joins them. Zero params give only the
    structure."""
    from purestep.core.cli.command import parse_args
    from purestep.core.config import resolve
    from purestep.core.parallel.distributed import Dist
    from purestep.recipes import standard
    from purestep.recipes.train import setup
    pairs, _ = parse_args([*args, f"resume={path}"])
    del pairs["recipe"]
    cfg = resolve(standard.Config, presets=standard.PRESETS, preset=pairs.pop("preset"), overrides=pairs)
    zeros = tree_map(torch.zeros_like, ckpt.load(path)["state"]["params"])
    runs = [setup.start(cfg, path.parent, zeros, device=torch.device("cpu"),
                        dist=Dist(r, world, r, sharded=world > 1)) for r in range(world)]
    if world == 1:
        return ckpt.to_state_dict(runs[0].state)
    layout = runs[0].layout

    def join(spec, *pieces):
        if spec.dim is None:                       # replicated: every rank holds the same
            assert all(equal(p, pieces[0]) for p in pieces)
            return pieces[0]
        return layout._join(torch.stack([p.reshape(-1) for p in pieces]), spec)
    state = runs[0].state._replace(params=tree_map(join, layout.params, *(r.state.params for r in runs)),
                                   opt_state=tree_map(join, layout.opt, *(r.state.opt_state for r in runs)))
    return ckpt.to_state_dict(state)


def _unequal_named(a: dict, b: dict) -> list:
    """The dotted names where two nested dicts with the same keys differ: a tensor not equal bit for bit (dtype
    included), any other value not ==."""
    from purestep.core.tree import named_leaves
    na, nb = dict(named_leaves(a)), dict(named_leaves(b))
    assert na.keys() == nb.keys(), sorted(set(na) ^ set(nb))
    def same(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        return type(x) is type(y) and x == y
    return [k for k, x in na.items() if not same(x, nb[k])]


def _losses(path: Path) -> dict:
    import json
    return {r["step"]: r["train/loss"] for r in map(json.loads, path.read_text().splitlines()) if "train/loss" in r}


@pytest.mark.parametrize("world", [2, 3])
def test_layout_cuts_and_joins_every_leaf_bitwise(world):
    """Each rank's cut of a full leaf, joined as the all-gather joins them, is the leaf again, bit for bit
    (uneven sizes padded); the moments follow their params and the hyperparameters stay whole."""
    cfg = llama.LlamaConfig(vocab_size=61, d_model=24, n_layers=2, n_heads=4)
    params = llama.init(cfg, 0)
    opt = make_optimizer(OptimizerSpec(lr=1e-3, clipping="adagc"))
    layouts = [Layout(params, opt.init, stacked=stacked_predicate(None), world=world, rank=r) for r in range(world)]
    state = opt.init(params)
    state = tree_map(lambda t: torch.randn_like(t) if t.is_floating_point() else t, state)
    for tree, specs in ((params, "params"), (state, "opt")):
        cuts = [tree_map(lay._cut, tree, getattr(lay, specs)) for lay in layouts]

        def join(spec, *pieces):
            if spec.dim is None:
                assert all(torch.equal(p, pieces[0]) for p in pieces)
                return pieces[0]
            return layouts[0]._join(torch.stack([p.reshape(-1) for p in pieces]), spec)
        joined = tree_map(join, getattr(layouts[0], specs), *cuts)
        assert equal(joined, tree)
    assert layouts[0].params["layers"]["attn"]["wq"].dim == 1 and layouts[0].params["embed"].dim == 0
    adam_mu = [s for s in tree_leaves(layouts[0].opt) if s.dim is not None]
    assert len(adam_mu) == 2 * len(tree_leaves(params))     # AdamW's two moments sharded, nothing else


@pytest.mark.parametrize("saved, loaded", [((3, 1), (2, 1)), ((3, 1), (4, 1)), ((3, 1), (2, 2)), ((2, 2), (3, 1))])
def test_each_rank_reads_its_cut_of_a_checkpoint_saved_on_another_mesh(saved, loaded, tmp_path):
    """``Layout.load``: a checkpoint saved as every rank's pieces (``checkpoint_shards``: rank 0's index, one file a
    rank) on a mesh of ``(fsdp ranks, tensor-parallel ranks)`` is read by each rank of another mesh straight into its
    own cut, box by box from the pieces, and the cut is bit for bit ``Layout.shard``'s of the whole state; a one-file
    checkpoint of the same state loads the same."""
    from purestep.core.io.checkpoint_shards import BOXES, SHARDS, shard_name, split
    from purestep.core.parallel.tensor import TensorParallel
    from purestep.core.state import init_state
    from purestep.core.tree import cast
    cfg = llama.LlamaConfig(vocab_size=61, d_model=24, n_layers=2, n_heads=4)
    params = {**llama.init(cfg, 0), "theta": torch.tensor(2.0)}     # a 0-d leaf: past rank 0, padding only
    opt = make_optimizer(OptimizerSpec(lr=1e-3, clipping="adagc"))
    state = init_state(params, opt, 0, "fp32")
    state = state._replace(opt_state=tree_map(lambda t: torch.randn_like(t) if t.is_floating_point() else t,
                                              state.opt_state))

    def mesh(world, tp):      # every rank's layout, in global rank order (the tensor-parallel rank fastest)
        return [Layout(params, opt.init, stacked=stacked_predicate(None), world=world, rank=r,
                       tensor=None if tp == 1 else TensorParallel(tp, t, None))
                for r in range(world) for t in range(tp)]
    writers, marked = mesh(*saved), set()
    names = [shard_name(7, i, len(writers)) for i in range(len(writers))]
    for layout, name in zip(writers, names):
        data, boxes = layout.pieces(layout.shard(state))
        ckpt.save(tmp_path / name, data, step=7, extra={BOXES: boxes})
        marked |= set(boxes)
    ckpt.save(tmp_path / "step_000000007.msgpack", split(ckpt.to_state_dict(state), marked), step=7,
              extra={SHARDS: names})
    ckpt.save(tmp_path / "whole.msgpack", state, step=7)
    template = init_state(cast(params, device="meta"), opt, 0, "fp32")
    for i, mine in enumerate(mesh(*loaded)):
        for path in ("step_000000007.msgpack", "whole.msgpack"):
            assert equal(mine.load(tmp_path / path, template)["state"], mine.shard(state)), (i, path)


def test_parallel_fsdp_without_a_launcher_is_one_line_exit_2(corpus, tmp_path):
    child_env = {k: v for k, v in env().items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run([sys.executable, str(REPO / "bin" / "run"),
                           *merge_args(*TINY, f"data={corpus}", "parallel=fsdp",
                           f"out={tmp_path / 'x'}")], cwd=tmp_path, env=child_env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel=fsdp needs a launcher" in lines[0], proc.stderr


def test_what_cannot_be_sharded_is_a_one_line_error_naming_it(corpus, tmp_path, capsys):
    from purestep.core.config import ConfigError
    from purestep.core.parallel.distributed import Dist
    from purestep.recipes.train.setup import sharded_layout
    assert main([*TINY, f"data={corpus}", "parallel=fsdp", "clipping=agc", f"out={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "clipping=agc with parallel=fsdp" in err[0]
    params = {"embed": torch.zeros(4, 2), "layers": {"gate": torch.zeros(3)}}     # a per-layer scalar: [L]
    with pytest.raises(ConfigError, match=r"parallel=fsdp: layers.gate: a stacked leaf of shape \(3,\)"):
        sharded_layout(Dist(0, 2, 0, sharded=True), params, lambda p: (), "fp32")


def _rank_pid(parent: int, rank: int) -> int:
    """The pid of torchrun's worker with ``RANK=rank`` (a child of ``parent``)."""
    for pid in _children(parent):
        try:
            if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no worker with RANK={rank} under pid {parent}")


def _children(parent: int) -> list:
    """The pids of ``parent``'s children (torchrun's workers, which leave its process group)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                pids.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return pids


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker's pid through /proc")
def test_a_killed_rank_stops_the_run_within_a_minute_naming_it_and_the_newest_checkpoint_resumes(corpus, tmp_path):
    import signal
    import time
    common = [*TINY, f"data={corpus}", "batch_size=4", "parallel=fsdp", "eval_every=0", f"out={tmp_path / 'run'}"]
    child = subprocess.Popen(["torchrun", "--standalone", "--nproc_per_node=2", str(REPO / "bin" / "run"),
                              *merge_args(*common, "steps=5000", "decay_steps=5000")], cwd=tmp_path, env=env(),
                             stderr=subprocess.PIPE, text=True)
    seen = []
    for line in child.stderr:                     # a checkpoint at step 10 is on disk once step 15 is logged
        seen.append(line)
        if line.startswith("step 15/"):
            break
    os.kill(_rank_pid(child.pid, 1), signal.SIGKILL)
    killed = time.monotonic()
    rest = child.stderr.read()
    assert child.wait(timeout=60) != 0 and time.monotonic() - killed < 60
    assert "rank 1 of 2 died" in rest and "stopped without a checkpoint" in rest, "".join(seen)[-2000:] + rest[-3000:]
    newest = ckpt.latest(tmp_path / "run")
    step = ckpt.read_meta(newest)["step"]
    assert step >= 10 and f"{newest}, is intact" in rest, rest[:1500]
    again = torchrun([*common, f"steps={step + 5}", f"decay_steps={5000}"], tmp_path)
    assert again.returncode == 0 and f"resuming from {newest} at step {step}" in again.stderr, again.stderr[-3000:]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's workers through /proc")
def test_two_nodes_killed_mid_run_resume_on_one_node_to_the_uninterrupted_state(corpus, tmp_path):
    """Two ``torchrun --nnodes=2 --nproc_per_node=2`` launches (c10d rendezvous on localhost: 4 ranks of 2 rows)
    train under ``parallel=fsdp`` and are killed with SIGKILL, every process of both, once a checkpoint is on disk;
    ``--nnodes=1 --nproc_per_node=2`` (2 ranks of 4 rows: the same global batch) resumes the run from it and ends
    where one uninterrupted process of 8 rows ends."""
    import signal
    import time
    common = merge_args(*TINY, f"data={corpus}", "eval_every=0", "steps=60", "decay_steps=60")
    assert main([*common, "batch_size=8", f"out={tmp_path / 'straight'}"]) == 0
    run, port = tmp_path / "run", _free_port()
    nodes = [subprocess.Popen(["torchrun", "--nnodes=2", "--nproc_per_node=2", f"--node_rank={i}",
                               "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}", "--rdzv_id=two-nodes",
                               str(REPO / "bin" / "run"), *merge_args(*common, "batch_size=2", "parallel=fsdp",
                                                                       "steps=5000", f"out={run}")],
                              cwd=tmp_path, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    deadline = time.monotonic() + 240       # killed at its first checkpoint, long before step 60
    while ckpt.latest(run) is None and time.monotonic() < deadline and all(n.poll() is None for n in nodes):
        time.sleep(0.05)
    for n in nodes:                          # every process of both launches: the ranks, then the agents
        for pid in _children(n.pid):
            os.kill(pid, signal.SIGKILL)
        n.kill()
    errors = [n.communicate()[1] for n in nodes]
    newest = ckpt.latest(run)
    assert newest is not None, errors[0][-3000:] + errors[1][-3000:]
    step = ckpt.read_meta(newest)["step"]
    assert step < 60 and not (run / "final.msgpack").exists() and "fsdp over 4 ranks" in "".join(errors)
    again = torchrun([*common, "batch_size=4", "parallel=fsdp", f"out={run}"], tmp_path)
    assert again.returncode == 0 and f"resuming from {newest} at step {step}" in again.stderr, again.stderr[-3000:]
    one, two = (ckpt.load(tmp_path / name / "final.msgpack")["state"] for name in ("straight", "run"))
    assert max_abs_diff(one["params"], two["params"]) < 1e-6 and max_abs_diff(one["opt_state"], two["opt_state"]) < 1e-6


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory):
    """A tiny byte-level Llama (d=64, 2 layers, 4 heads) trained 10 steps: a teacher for distill and upcycle."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    assert main(["recipe=standard", "preset=tiny", "compile=false", "sample_tokens=0", "steps=10", "eval_every=0",
                 f"data={corpus}", f"out={out}"]) == 0
    return out


def _diff(a, b) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(tree_leaves(a), tree_leaves(b))
               if x.numel())


def test_sharded_distillation_equals_one_process(corpus, teacher, tmp_path, one_thread):
    """The student (its learnable temperature too, a 0-d leaf) and the teacher (``teacher_shard=true``, its layers
    gathered one at a time as it runs) sharded over 2 ranks; the 2 ranks recompute the student's blocks (``remat=true``, each block's layer gathered again for
    its recomputation), the one process does not."""
    common = ["recipe=distill", f"teacher={teacher}", f"data={corpus}", "compile=false", "sample_tokens=0",
              "steps=20", "eval_every=10", "eval_batches=4", "block_size=32", "log_every=5", "clipping=adagc",
              "adagc.warmup=5", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
              "temperature_mode=learnable", "temperature=2"]
    assert main([*common, "batch_size=8", f"out={tmp_path / 'one'}"]) == 0
    two = torchrun([*common, "batch_size=4", "parallel=fsdp", "teacher_shard=true", "remat=true",
                    f"out={tmp_path / 'two'}"], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "teacher sharded across 2 ranks, gathered one block at a time as it runs" in two.stderr
    one_ck, two_ck = (ckpt.load(tmp_path / n / "final.msgpack") for n in ("one", "two"))
    assert _diff(one_ck["state"]["params"], two_ck["state"]["params"]) < 1e-6
    assert abs(one_ck["val_loss"] - two_ck["val_loss"]) < 1e-6


def _standard_and_distill(corpus, teacher) -> tuple:
    """The eager 20-step standard and distill runs the multi-rank equality tests compare with one process: ``(name,
    keys)``, without ``batch_size``, ``out`` or the parallel keys."""
    standard = [*TINY, f"data={corpus}", "save_every=0"]
    distill = ["recipe=distill", f"teacher={teacher}", f"data={corpus}", "compile=false", "sample_tokens=0",
               "steps=20", "eval_every=10", "eval_batches=4", "block_size=32", "log_every=5", "model.d_model=32",
               "model.n_layers=2", "model.n_heads=2", "temperature_mode=learnable", "temperature=2"]
    return ("standard", standard), ("distill", distill)


@pytest.fixture(scope="module")
def one_process(corpus, teacher, tmp_path_factory) -> dict:
    """The one-process twins of the 4-rank equality tests (``_standard_and_distill`` at 8 rows a step), each run once
    for the module, on one thread as the ranks run: ``{name: run folder}``."""
    folder, before = tmp_path_factory.mktemp("one-process"), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, common in _standard_and_distill(corpus, teacher):
            assert main([*common, "batch_size=8", f"out={folder / name}"]) == 0
    finally:
        torch.set_num_threads(before)
    return {name: folder / name for name, _ in _standard_and_distill(corpus, teacher)}


def test_four_sharded_ranks_equal_one_process_on_standard_and_distill(corpus, teacher, one_process, tmp_path):
    """Eager, 20 steps, 4 gloo ranks of 2 rows against one process of 8: standard (a stacked leaf of 4 rows per layer
    split 1 each) and distill (the learnable temperature, a 0-d leaf, on rank 0 alone), every logged loss and the
    final params within 1e-6. The compiled twins: tests/test_default_paths.py."""
    for name, common in _standard_and_distill(corpus, teacher):
        four = torchrun([*common, "batch_size=2", "parallel=fsdp", "checkpoint_shards=true", f"out={tmp_path / name}"],
                        tmp_path, ranks=4)
        assert four.returncode == 0, four.stderr[-3000:]
        assert "parallel: fsdp over 4 ranks" in four.stderr
        one_ck, four_ck = (ckpt.load(f / "final.msgpack") for f in (one_process[name], tmp_path / name))
        assert _diff(one_ck["state"]["params"], four_ck["state"]["params"]) < 1e-6, name
        losses = [_losses(f / "metrics.jsonl") for f in (one_process[name], tmp_path / name)]
        assert len(losses[0]) == 4 and losses[0].keys() == losses[1].keys(), name
        assert max(abs(losses[0][k] - losses[1][k]) for k in losses[0]) < 1e-6, name


@pytest.mark.skipif(bool(cpu_tensor_parallel_refusal()), reason=cpu_tensor_parallel_refusal())
def test_tensor_parallel_on_a_2x2_mesh_equals_one_process_eager(corpus, teacher, one_process, tmp_path):
    """``parallel=fsdp,tp mesh=dp:2,tp:2``, eager, 20 steps: 2 data-parallel ranks of 4 rows, each block's heads and
    MLP features split over 2 tensor-parallel ranks, against one process of 8 rows: distill (the frozen teacher whole
    on every rank, its blocks run as they are; the learnable temperature). Every logged loss within 1e-6 of the one
    process's relative to it, the final params within 1e-4: a row-parallel product is summed in two pieces and rounds
    apart from the whole one, and AdamW's normalized step carries that into the params (up to 2.9e-5 in distill's
    ``wo``, compiled). Standard under fsdp,tp: the compiled default-path job (tests/test_default_paths.py). The
    checkpoints are written as every rank's pieces (``checkpoint_shards=true``), joined when loaded."""
    for name, common in _standard_and_distill(corpus, teacher)[1:]:
        four = torchrun([*common, "batch_size=4", "parallel=fsdp,tp", "mesh=dp:2,tp:2", "checkpoint_shards=true",
                         f"out={tmp_path / name}"], tmp_path, ranks=4)
        assert four.returncode == 0, four.stderr[-3000:]
        assert "parallel: fsdp over 2 ranks" in four.stderr and "tensor parallel over 2 ranks" in four.stderr
        one_ck, tp_ck = (ckpt.load(f / "final.msgpack") for f in (one_process[name], tmp_path / name))
        assert _diff(one_ck["state"]["params"], tp_ck["state"]["params"]) < 1e-4, name
        losses = [_losses(f / "metrics.jsonl") for f in (one_process[name], tmp_path / name)]
        assert len(losses[0]) == 4 and losses[0].keys() == losses[1].keys(), name
        assert max(abs(losses[0][k] - losses[1][k]) / losses[0][k] for k in losses[0]) < 1e-6, (name, losses)


def test_hybrid_sharding_on_a_2x2_mesh_equals_one_process(corpus, one_process, tmp_path):
    """``parallel=hsdp mesh=rep:2,dp:2``, eager, 20 steps: the state sharded over 2 ranks and replicated in 2 such
    groups, each of the 4 ranks reading 2 rows, against one process of 8 rows (AdaGC and gradient health): each rank
    holds half the state, every logged loss and the final params within 1e-6 (the compiled one-graph step, by hand:
    4.8e-7 and 4.0e-7, docs/scale.md)."""
    (_, common), _ = _standard_and_distill(corpus, None)
    four = torchrun([*common, "batch_size=2", "parallel=hsdp", "mesh=rep:2,dp:2", "checkpoint_shards=true",
                     f"out={tmp_path / 'hsdp'}"], tmp_path, ranks=4)
    assert four.returncode == 0, four.stderr[-3000:]
    assert "hsdp: 2 replicas of the shards" in four.stderr
    assert len(re.findall(r"rank \d \d+\.\d+ MiB \(0\.500x\)", four.stderr)) == 4, four.stderr    # half each
    one_ck, hsdp_ck = (ckpt.load(f / "final.msgpack") for f in (one_process["standard"], tmp_path / "hsdp"))
    assert _diff(one_ck["state"]["params"], hsdp_ck["state"]["params"]) < 1e-6
    losses = [_losses(f / "metrics.jsonl") for f in (one_process["standard"], tmp_path / "hsdp")]
    assert len(losses[0]) == 4 and losses[0].keys() == losses[1].keys()
    assert max(abs(losses[0][k] - losses[1][k]) for k in losses[0]) < 1e-6, losses


def test_mesh_keys_that_cannot_hold_are_one_line_errors(corpus, tmp_path, capsys):
    from purestep.core.config import ConfigError
    from purestep.core.parallel.distributed import parse_mesh
    upcycle = ["recipe=upcycle", "teacher=smollm2", f"data={corpus}", "parallel=fsdp,tp"]
    distill = ["recipe=distill", "teacher=smollm2", f"data={corpus}", "parallel=fsdp,tp", "teacher_shard=true"]
    for keys, says in (([*TINY, "mesh=dp:2,tp:2"], "mesh=dp:2,tp:2 lays out the ranks of parallel=fsdp,tp or hsdp"),
                       ([*TINY, "parallel=fsdp,tp", "mesh=dp:1,tp:2", "compile_scope=step"],
                        "compile_scope=step with parallel=fsdp,tp"),
                       (upcycle, "parallel=fsdp,tp runs recipe=standard and recipe=distill"),
                       ([*upcycle[:-1], "parallel=hsdp"], "parallel=hsdp runs recipe=standard and recipe=distill"),
                       (distill, "teacher_shard=true with parallel=fsdp,tp")):
        assert main([f"data={corpus}", *keys, f"out={tmp_path / 'x'}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert parse_mesh("dp:2,tp:2", 4) == (2, 2)
    with pytest.raises(ConfigError, match="dp x tp = 4 ranks, but torchrun started 2"):
        parse_mesh("dp:2,tp:2", 2)
    with pytest.raises(ConfigError, match="needs mesh=dp:D,tp:T"):
        parse_mesh("dp:2", 2)
    assert parse_mesh("dp:2,rep:3", 6, ("rep", "dp")) == (3, 2)
    with pytest.raises(ConfigError, match="parallel=hsdp needs mesh=rep:R,dp:D"):
        parse_mesh("dp:2,tp:2", 4, ("rep", "dp"))


def test_sharded_upcycle_blockwise_and_global_phases_equal_one_process(corpus, teacher, tmp_path, one_thread):
    common = ["recipe=upcycle", f"teacher={teacher}", f"data={corpus}", "preset=ci", "phases=blockwise,global",
              "blockwise.steps=10", "global.steps=10", "global.eval_every=5"]
    assert main([*common, "blockwise.batch_size=4", "global.batch_size=4", f"out={tmp_path / 'one'}"]) == 0
    two = torchrun([*common, "blockwise.batch_size=2", "global.batch_size=2", "parallel=fsdp",
                    f"out={tmp_path / 'two'}"], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stderr.count("parallel: fsdp over 2 ranks") == 2          # both trained phases, said once each
    for phase in ("blockwise", "global"):
        one_ck, two_ck = (ckpt.load(tmp_path / n / phase / "final.msgpack") for n in ("one", "two"))
        assert _diff(one_ck["state"]["params"], two_ck["state"]["params"]) < 1e-6, phase
        assert _diff(one_ck["state"]["opt_state"], two_ck["state"]["opt_state"]) < 1e-6, phase


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-rank gloo process group in this process (the collectives of the sharded step run for real)."""
    import torch.distributed as dist
    torch._dynamo.reset()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
    torch._dynamo.reset()


def _explained_step(group, clipping: str):
    """``torch._dynamo.explain`` of the sharded step (over ``group``, one rank) of a tiny Llama with gradient health,
    on its second call (the first builds it, its DeviceMesh too, outside what dynamo traces)."""
    from purestep.core.state import init_state
    from purestep.core.step import make_train_step
    from purestep.optim.health import GradientHealth
    cfg = llama.LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2)
    params = llama.init(cfg, 0)
    spec = OptimizerSpec(lr=1e-2, clipping=clipping, adagc=AdaGCConfig(warmup=1))
    layout = Layout(params, make_optimizer(spec).init, stacked=stacked_predicate(None), world=1, rank=0, group=group)
    step = make_train_step(lambda p, b, layers=None: llama.loss(p, b, cfg, layers=layers),
                           make_optimizer(spec, sharded=True), gradients=Gradients(mode="func"),
                           monitors=Monitors(GradientHealth(params).metrics), parallel=Parallel(shard=layout))
    state = layout.shard(init_state(params, make_optimizer(spec, sharded=True)))
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randint(0, 32, (2, 8), generator=g), "y": torch.randint(0, 32, (2, 8), generator=g)}
    step(state, batch)
    return torch._dynamo.explain(step)(state, batch)


@pytest.mark.parametrize("remat,tensor", [(False, False), (True, False), (False, True)])
def test_the_eager_sharded_step_gathers_one_block_at_a_time_and_keeps_none_for_backward(one_rank_group, remat, tensor,
                                                                                        monkeypatch):
    """Layer i is gathered when the model's loop reaches it, and backward gathers layers L-2 .. 0 again (the last is
    still held): nothing autograd saved, nor under remat the checkpoint, kept a gathered layer; nor, tensor parallel
    (``parallel=fsdp,tp`` on a 1 x 1 mesh: the blocks run on DTensor views of the pieces), a saved DTensor. Each
    gather but the first of a pass was started one layer ahead (prefetched: layer i + 1 while i computes, i - 1 in
    backward). Two micro-batches reduce-scatter each layer once, in the last one's backward. Under bf16 the layers come
    gathered in bf16. The step and the per-block eval equal the plain ones (fp32; bf16: the loss to bf16 rounding)."""
    from purestep.core.parallel.tensor import mesh
    tp = mesh("cpu", 1, 1) if tensor else None
    from purestep.core.parallel import shard_blocks
    from purestep.core.state import init_state
    from purestep.core.step import make_eval_step, make_train_step
    from purestep.core.tree import clone
    gathers, reduces, gather, reduce_rows = [], [], shard_blocks.Blocks.gather, Layout.reduce_rows

    def counted(self, idx, k):
        started = (tuple(idx), k) in self.pending          # prefetched
        out = gather(self, idx, k)
        gathers.append((k, {t.dtype for t in out}, started))
        return out
    monkeypatch.setattr(shard_blocks.Blocks, "gather", counted)
    monkeypatch.setattr(Layout, "reduce_rows", lambda self, rows, **kw: reduces.append(len(rows)) or reduce_rows(self, rows, **kw))
    cfg = llama.LlamaConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2)
    params = llama.init(cfg, 0)
    spec = OptimizerSpec(lr=1e-2, clipping="adagc", adagc=AdaGCConfig(warmup=1))
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.randint(0, 32, (2, 2, 8), generator=g) for k in ("x", "y")}       # 2 micro-batches of 2 rows
    first = {k: v[0] for k, v in batch.items()}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        layout = Layout(params, make_optimizer(spec).init, stacked=stacked_predicate(None), world=1, rank=0,
                        group=one_rank_group, gather_dtype=dtype if precision == "bf16" else None, tensor=tp)
        runs = []
        for shard in (None, layout):
            opt = make_optimizer(spec, sharded=shard is not None)
            loss = lambda p, b, layers=None: llama.loss(p, b, cfg, remat=remat, layers=layers)       # noqa: E731
            step = make_train_step(loss, opt, precision=precision, gradients=Gradients(accum=2, remat=remat),
                                   parallel=Parallel(shard=shard))
            state = init_state(clone(params), opt)
            gathers.clear()
            reduces.clear()
            state, metrics = step(shard.shard(state) if shard else state, batch)
            evaluate = make_eval_step(loss, precision=precision, shard=shard)
            runs.append((state, metrics, evaluate(state.params, first)["loss"]))
        assert [k for k, _, _ in gathers] == [0, 1, 2, 1, 0] * 2 + [0, 1, 2]      # 2 micro-batches, then the eval
        assert [started for _, _, started in gathers] == [False, True, True, True, True] * 2 + [False, True, True]
        assert all(dtypes == {dtype} for _, dtypes, _ in gathers)
        assert reduces == [9, 9, 9, 2]      # layers 2, 1, 0 (9 stacked leaves each), then embed and norm
        (plain, plain_metrics, plain_eval), (sharded, metrics, sharded_eval) = runs
        if precision == "fp32":     # tensor parallel: SDPA's math kernel on the CPU, rounding apart from its flash one
            within = 1e-5 if tensor else 1e-6
            assert _diff(plain.params, layout.gather_state(sharded).params) < within
            assert _diff(plain_metrics, metrics) < within and abs(plain_eval - sharded_eval) < within
        else:     # the model runs on bf16 weights, not fp32 ones cast by autocast: the loss to bf16 rounding
            assert abs(plain_metrics["loss"] - metrics["loss"]) < 1e-3


def test_a_sharded_teacher_is_gathered_one_block_at_a_time_as_the_loss_runs_it(one_rank_group, monkeypatch):
    """``Parallel(frozen_shards={"teacher": layout})`` (``teacher_shard=true``): the eager sharded step gathers the
    frozen teacher's layers one at a time as the loss runs them, between the student's forward and backward, and
    backward gathers only the student's again; the step equals the one with the whole teacher handed in. With each
    block compiled (``compile_scope=block``) the gathers are the same, in the Python loop around the block graphs, and
    the step equals its compiled twin with the whole teacher. A step that gathers the student whole (one graph,
    ``torch.func``) gathers the teacher whole before it."""
    from purestep.core.parallel import shard_blocks
    from purestep.core.state import init_state
    from purestep.core.step import make_train_step
    from purestep.core.tree import clone
    gathers, gather = [], shard_blocks.Blocks.gather
    monkeypatch.setattr(shard_blocks.Blocks, "gather",
                        lambda self, idx, k: gathers.append((self.anchor is None, k)) or gather(self, idx, k))
    student_cfg = llama.LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2)
    teacher_cfg = llama.LlamaConfig(vocab_size=32, d_model=24, n_layers=3, n_heads=2)
    params, teacher = llama.init(student_cfg, 0), llama.init(teacher_cfg, 1)

    def loss(p, b, frozen, layers=None):
        with torch.no_grad():
            target = llama.apply(frozen["teacher"], b["x"], teacher_cfg, layers=layers).softmax(-1)
        logits = llama.apply(p, b["x"], student_cfg, layers=layers)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randint(0, 32, (2, 8), generator=g)}
    teacher_layout = Layout(teacher, lambda q: (), stacked=stacked_predicate(None), world=1, rank=0,
                            group=one_rank_group)
    opt = make_optimizer(OptimizerSpec(lr=1e-2), sharded=True)
    layout = Layout(params, opt.init, stacked=stacked_predicate(None), world=1, rank=0, group=one_rank_group)
    runs, shards = [], teacher_layout.shard_params(teacher)
    sharded = {"teacher": teacher_layout}
    for frozen_shards, frozen, mode, scope in (({}, teacher, None, None), (sharded, shards, None, None),
                                               (sharded, shards, "func", None), (sharded, shards, None, "block"),
                                               ({}, teacher, None, "block")):
        gathers.clear()
        step = make_train_step(loss, opt, gradients=Gradients(mode=mode),
                               compile=Compile(enabled=scope is not None, scope=scope or "step"),
                               parallel=Parallel(shard=layout, frozen_shards=frozen_shards))
        runs.append(step(layout.shard(init_state(clone(params), opt)), batch, {"teacher": frozen})[0])
        if frozen_shards and mode is None:   # eager, and each block compiled (compile_scope=block) alike
            assert gathers == [(True, 0), (True, 1), (True, 2), (False, 0), (False, 1), (False, 0)]
        if mode == "func":      # the one-graph path: both gathered whole before the step
            assert gathers == []
    assert equal(runs[0], runs[1]) and _diff(runs[0].params, runs[2].params) < 1e-6
    assert equal(runs[3], runs[4])     # compiled blocks: the same graphs as with the whole teacher handed in


def test_a_sharded_run_from_init_keeps_only_the_shards_of_the_loaded_params(corpus, tmp_path, monkeypatch):
    """``recipe=standard init=... parallel=fsdp`` (one rank, as torchrun starts it): once the ranks hold their shards,
    the loaded model's params are dropped (shapes on the meta device stay for the run's log), not kept whole for the
    run beside them."""
    import socket
    import torch.distributed as dist
    from purestep.core.config import resolve
    from purestep.recipes import standard
    assert main([*TINY, f"data={corpus}", "steps=2", "save_every=0", "eval_every=0", f"out={tmp_path / 'a'}"]) == 0
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    cfg = resolve(standard.Config, overrides={"init": str(tmp_path / "a"), "data": str(corpus), "parallel": "fsdp",
                                              "compile": "false", "out": str(tmp_path / "b")})
    try:
        p = standard.prepare_run(cfg, write=False)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert p.run.layout is not None and p.start is not None
    assert {t.device.type for t in tree_leaves(p.start.params)} == {"meta"}


def _dtensor_update(rank: int, init: str, out: str) -> None:
    """One of 2 spawned gloo ranks of the test below (``on_dtensors``' all-reduces): writes the all-reduce count and the gaps to the plain update (params absolute, metrics relative)."""
    import json
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode
    from purestep.core.state import init_state
    from purestep.core.tree import clone
    from purestep.core.update import apply_gradients
    from purestep.optim.health import GradientHealth
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    cfg = llama.LlamaConfig(vocab_size=33, d_model=16, n_layers=2, n_heads=2)     # 33 rows: an uneven split
    params = llama.init(cfg, 0)
    opt = make_optimizer(OptimizerSpec(lr=1e-2, clipping="global"), sharded=True)
    layout = Layout(params, opt.init, stacked=stacked_predicate(None), world=2, rank=rank, group=dist.group.WORLD)
    monitors = Monitors(GradientHealth(params, clip_norm=1.0))

    def apply(state, grads, loss, aux, due=None):
        return apply_gradients(state, grads, opt, loss=loss, aux=aux, monitors=monitors, due=due)
    grads = tree_map(lambda p: torch.randn_like(p), params)
    plain, plain_metrics = apply(init_state(clone(params), opt), grads, torch.tensor(2.0), {})
    with CommDebugMode() as comm:
        sharded, metrics = layout.on_dtensors(apply, "cpu")(layout.shard(init_state(clone(params), opt)),
                                                            layout.shard_params(grads), torch.tensor(2.0), {})
    result = {"comms": {str(k): v for k, v in comm.get_comm_counts().items()},
              "params": _diff(plain.params, layout.gather_state(sharded).params),
              "metrics": max(((a.double() - b.double()).abs() / b.double().abs().clamp_min(1)).max().item()
                             for a, b in zip(tree_leaves(metrics), tree_leaves(plain_metrics)))}   # relative
    dist.destroy_process_group()
    Path(out).with_suffix(f".{rank}.json").write_text(json.dumps(result))


def test_the_update_on_dtensor_shards_makes_each_statistic_whole_in_one_all_reduce(tmp_path):
    """``Layout.on_dtensors`` on 2 gloo ranks: the optimizer, the norms and gradient health see DTensors and take no
    collective of their own; each whole-model statistic is one all-reduce of partial sums (the gradient norm, global
    clipping's norm, the health rows, the parameter norm: 4), and the update equals the plain one."""
    import json
    torch.multiprocessing.spawn(_dtensor_update, args=(f"file://{tmp_path / 'pg'}", str(tmp_path / "out")), nprocs=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert result["comms"] == {"c10d_functional.all_reduce": 4}, result
        assert result["params"] < 1e-6 and result["metrics"] < 1e-5, result


def test_the_sharded_step_traces_into_one_graph(one_rank_group):
    """Dynamo traces the whole sharded step (all-gather, reduce-scatter, the whole-model norms of global clipping,
    AdaGC and health) as one graph without a break: what ``compile=true compile_scope=step`` runs (compiled, on 2
    and 4 ranks: tests/test_default_paths.py)."""
    for clipping in ("global", "adagc"):
        explanation = _explained_step(one_rank_group, clipping)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1


@pytest.mark.slow
def test_sharded_compression_equals_one_process(corpus, teacher, tmp_path, one_thread):
    common = ["recipe=compress", f"teacher={teacher}", f"data={corpus}", "d_compressed=8", "steps=20",
              "train_tokens=2048", "val_tokens=512", "block_size=32", "eval_every=10", "warmup_steps=2"]
    assert main([*common, "batch_size=8", f"out={tmp_path / 'one'}"]) == 0
    two = torchrun([*common, "batch_size=4", "parallel=fsdp", f"out={tmp_path / 'two'}"], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    one_ck, two_ck = (ckpt.load(tmp_path / n / "stage1a_best.msgpack") for n in ("one", "two"))
    assert _diff(one_ck["state"]["params"], two_ck["state"]["params"]) < 1e-6
    assert abs(one_ck["metrics"]["cosine"] - two_ck["metrics"]["cosine"]) < 1e-6
