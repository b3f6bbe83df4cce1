"""Run-management keys of TrainConfig: save_every_minutes (checkpoints by wall time, on a fake clock),
compile_mode (reaches torch.compile) and tf32 (ignored with a warning off CUDA)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from purestep.core.io.logging import Logger
from purestep.recipes import main
from purestep.recipes.train.checkpointing import Checkpointing
from purestep.recipes.train.hooks import Run, StepContext
from purestep.recipes.train.loop import FitResult, LoopState
from purestep.core.step import Compile
from purestep.core.cli.command import merge_args  # noqa: E402 (bin/run refuses a repeated key)

pytestmark = pytest.mark.usefixtures("token_cache")   # tests/conftest.py

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "block_size=32", "batch_size=4",
        "compile=false", "sample_tokens=0", "eval_batches=1", "eval_every=0", "save_every=0", "keep_last=0"]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Manager:
    """Records the steps it is asked to save (a CheckpointManager's interface, nothing written)."""
    def __init__(self):
        self.saved = []

    def should_save(self, step: int) -> bool:
        return False

    def save(self, step, tree, extra=None, val_loss=None, final=False, stopped=False) -> Path:
        self.saved.append(step)
        return Path(f"step_{step}")


class AgreeingDist:
    """Two ranks, the other of which always says 'due' (a rank whose clock runs ahead)."""
    enabled, rank, world_size, is_main = True, 0, 2, True

    def __init__(self):
        self.asked = []

    def agree(self, flag: bool) -> bool:
        self.asked.append(flag)
        return True

    def barrier(self) -> None:   # after a save the ranks meet: the other one is there at once
        pass


def drive(hook: Checkpointing, clock: FakeClock, seconds_per_step: float, steps: int, total: int = 100):
    loop = LoopState()
    for step in range(1, steps + 1):
        clock.now += seconds_per_step
        ctx = StepContext(state=None, step=step, cursor=step, run=Run(total, loop, FitResult(None, loop)))
        hook.after_step(ctx)


def test_save_every_minutes_saves_by_wall_time_on_a_fake_clock(tmp_path):
    clock, manager = FakeClock(), Manager()
    hook = Checkpointing(manager, dict, Logger(".", enabled=False), every_minutes=1.5, clock=clock)
    drive(hook, clock, 40.0, 10)            # 90 s pass every 2.25 steps: due at 120 s, 240 s, 360 s ...
    assert manager.saved == [3, 6, 9]
    off = Manager()
    drive(Checkpointing(off, dict, Logger(".", enabled=False), clock=clock), clock, 1e6, 5)
    assert off.saved == []                  # 0 minutes: off however long it runs


def test_under_several_ranks_the_decision_is_agreed_at_log_steps():
    clock, manager, dist = FakeClock(), Manager(), AgreeingDist()
    hook = Checkpointing(manager, dict, Logger(".", enabled=False), every_minutes=10, dist=dist, log_every=4,
                         clock=clock)
    drive(hook, clock, 1.0, 12)             # this rank is never due; the other always is
    assert manager.saved == [4, 8, 12] and dist.asked == [False, False, False]


def test_the_key_reaches_the_loop_and_writes_step_checkpoints(corpus, tmp_path, monkeypatch):
    clock = FakeClock()
    ticks = iter(range(10_000))
    monkeypatch.setattr(Checkpointing, "clock", staticmethod(lambda: clock.now + 25.0 * next(ticks)))
    out = tmp_path / "run"
    assert main(["recipe=standard", f"data={corpus}", f"out={out}", *TINY, "steps=6",
                 "save_every_minutes=1"]) == 0
    steps = sorted(p.name for p in out.glob("step_*.msgpack"))
    # 25 s a clock reading (one per step, one per save): 75 s at step 3, then 50 s by step 5; 6 is the final
    assert steps == ["step_000000003.msgpack", "step_000000006.msgpack"], steps


def test_two_ranks_save_by_wall_time_together_at_log_steps(corpus, tmp_path):
    import os
    import subprocess
    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "two"                  # due after every step (a microsecond), agreed at log steps only
    proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2", str(repo / "bin" / "run"),
                           *merge_args("recipe=standard", f"data={corpus}", f"out={out}", *TINY, "steps=6",
                                       "log_every=3", "save_every_minutes=0.00000001")],
                          cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("step_*.msgpack")) == ["step_000000003.msgpack", "step_000000006.msgpack"]


# ---------------------------------------------------------------------------------------------- compile_mode

def test_compile_mode_reaches_torch_compile(monkeypatch):
    """The mode arrives as its options plus inductor's (``core.compile.inductor_options``: ``cond`` cacheable on every
    graph; the C++ wrapper on CPU steps without collectives, built apart from the kernels at -O0; no loop reordering
    after fusion on CUDA)."""
    from torch._inductor import list_mode_options
    from purestep.core import compile as compile_module
    from purestep.core.step import Gradients, Parallel, _train_step
    from purestep.core.update import Monitors
    from purestep.optim.adamw import adamw
    seen = []

    def fake_compile(fn, **kwargs):
        seen.append({k: v for k, v in kwargs.items() if k in ("mode", "options")})
        return fn
    monkeypatch.setattr(torch, "compile", fake_compile)
    compile_module.maybe_compile(lambda x: x, True, mode="max-autotune")
    compile_module.maybe_compile(lambda x: x, True)
    compile_module.maybe_compile(lambda x: x, True, cpp=True)
    cond = {"unsafe_marked_cacheable_functions": compile_module.CACHEABLE}     # every graph: cond cacheable
    cpp = {**cond, "cpp_wrapper": True, **dict(compile_module.SEPARATE_WRAPPER_BUILD)}
    assert seen == [{"options": {**list_mode_options("max-autotune"), **cond}},
                    {"options": {**list_mode_options("default"), **cond}},
                    {"options": {**list_mode_options("default"), **cpp}}]
    seen.clear()

    def loss(p, b, k):
        return (p["w"] * b).sum(), {}
    cpu = {"options": {**list_mode_options("max-autotune"), **cpp}}
    cuda = {"options": {**list_mode_options("max-autotune"), **cond, "loop_ordering_after_fusion": False}}
    collectives = {"options": {**list_mode_options("max-autotune"), **cond}}
    compile = Compile(scope="step", mode="max-autotune")
    for device_type, parallel, expected in (("cpu", Parallel(), cpu), ("cuda", Parallel(), cuda),
                                            ("cpu", Parallel(reduce=lambda ts: ts), collectives)):
        # what make_train_step builds on first use for a state on that device (collectives: the Python wrapper)
        _train_step(loss, adamw(1e-3), device_type, "fp32", compile, False, Gradients(), "func", Monitors(), parallel)
        assert seen and all(s == expected for s in seen), (device_type, parallel)
        seen.clear()


def test_cpu_ignores_tf32_and_reduce_overhead_with_a_warning(capsys):
    from purestep.recipes.train.backend import configure
    from purestep.recipes.train.config import TrainConfig
    before = torch.backends.cuda.matmul.allow_tf32
    mode = configure(TrainConfig(tf32=True, compile_mode="reduce-overhead"), torch.device("cpu"))
    err = capsys.readouterr().err
    assert mode == "default" and torch.backends.cuda.matmul.allow_tf32 == before
    assert "tf32=true is ignored on cpu" in err and "compile_mode=reduce-overhead is ignored on cpu" in err
    assert configure(TrainConfig(compile_mode="max-autotune"), torch.device("cpu")) == "max-autotune"
    assert configure(TrainConfig(compile=False, compile_mode="max-autotune"), torch.device("cpu")) == "default"
    assert "compile_mode=max-autotune is ignored with compile=false" in capsys.readouterr().err


def test_eval_compile_auto_compiles_only_runs_that_evaluate_many_batches():
    """``eval_compile=auto`` compiles the eval step when the run evaluates >= ``EVAL_COMPILE_BATCHES`` batches
    (evaluations every ``eval_every`` steps and at the end, once where the two meet, ``eval_batches`` each);
    true/false force it; nothing compiles under compile=false."""
    from purestep.recipes.train.backend import EVAL_COMPILE_BATCHES, eval_compiled
    from purestep.recipes.train.config import TrainConfig
    nanogpt = TrainConfig(steps=2000, eval_every=250, eval_batches=20)      # 8 evaluations (step 2000 once), 160
    assert not eval_compiled(nanogpt)
    per_eval = EVAL_COMPILE_BATCHES // 8
    assert eval_compiled(TrainConfig(steps=2000, eval_every=250, eval_batches=per_eval))
    assert not eval_compiled(TrainConfig(steps=2000, eval_every=250, eval_batches=per_eval - 1))
    assert eval_compiled(TrainConfig(steps=2100, eval_every=250, eval_batches=per_eval - 1))    # 8 + the end's
    assert not eval_compiled(TrainConfig(steps=10, eval_every=0, eval_batches=EVAL_COMPILE_BATCHES - 1))
    assert eval_compiled(TrainConfig(steps=10, eval_every=0, eval_batches=EVAL_COMPILE_BATCHES))
    assert eval_compiled(TrainConfig(eval_compile="true")) and not eval_compiled(TrainConfig(eval_compile="false",
                                                                                           eval_batches=5000))
    assert not eval_compiled(TrainConfig(compile=False, eval_compile="true"))


def test_bf16_on_a_cpu_without_native_bf16_warns(capsys, monkeypatch):
    """dtype=bf16 on a CPU that has neither avx512_bf16 nor AMX's bf16 (its /proc/cpuinfo flags) warns that fp32 is
    likely faster; with either, at fp32, or where the flags cannot be read, no warning."""
    from purestep.recipes.train import backend
    from purestep.recipes.train.config import TrainConfig
    flags = backend.cpu_flags()
    assert flags is None or (isinstance(flags, set) and flags), flags   # Linux's flags, or None where it cannot say
    for flags, warned in (({"avx2"}, True), ({"avx2", "avx512_bf16"}, False), ({"amx_bf16"}, False), (None, False)):
        monkeypatch.setattr(backend, "cpu_flags", lambda flags=flags: flags)
        backend.configure(TrainConfig(dtype="bf16"), torch.device("cpu"))
        backend.configure(TrainConfig(), torch.device("cpu"))
        err = capsys.readouterr().err
        assert ("dtype=bf16 on a CPU without avx512_bf16 or amx_bf16" in err) == warned, (flags, err)
