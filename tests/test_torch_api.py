"""Every private torch API the package uses, found in its source and checked here, so that a torch release that
renames, removes or changes one fails this file by name instead of a run somewhere later.

``PRIVATE`` lists each use (a dotted name reached from ``torch`` with a leading-underscore part, a private module
imported, ``Tensor._version``) with the public API that has none of it: as of torch 2.11 to 2.14 the
multi-tensor ``_foreach`` ops (``torch.optim``'s own kernels), inductor's config, dynamo's compile counter and
the functional collectives that dynamo traces have no public spelling. ``test_the_inventory_is_complete``
parses ``core/ models/ optim/ recipes/ bin/`` and fails on a private use not listed (or a listed one no longer
used); each other test pins what the code relies on.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["core", "models", "optim", "recipes", "bin"]

# name -> where it is used (and why no public API serves)
PRIVATE = {
    "torch._foreach_add": "optim/foreach.py, core/tree.py: multi-tensor kernels, as torch.optim's foreach path",
    "torch._foreach_add_": "optim/foreach.py",
    "torch._foreach_div": "optim/foreach.py",
    "torch._foreach_div_": "optim/foreach.py, optim/adamw.py",
    "torch._foreach_mul": "optim/foreach.py",
    "torch._foreach_sign_": "optim/lion.py",
    "torch._foreach_sqrt": "optim/foreach.py",
    "torch._inductor.config": "core/compile.py: which options this torch has (unsafe_marked_cacheable_functions, "
                              "triton.mix_order_reduction, cpp_wrapper_build_separate, "
                              "aot_inductor.compile_wrapper_opt_level; passed as torch.compile options, never set), "
                              "recipes/bench/speed.py (cpp.enable_kernel_profile)",
    "torch._inductor.list_mode_options": "core/compile.py: a mode's options plus cpp_wrapper",
    "torch._inductor.cpu_vec_isa": "core/cpu_compiles.py probe_vector_isa(): inductor's vector-ISA probes, started "
                                   "early (the purestep program's opt-in only)",
    "torch._inductor.codecache": "core/cpu_compiles.py build_objects_together(): _worker_compile_cpp, the list of C++ "
                                 "builds a graph needs (its two object files built at once), and LOCK_TIMEOUT (the "
                                 "purestep program's opt-in only)",
    "torch.utils._filelock": "core/cpu_compiles.py build_objects_together(): the file lock inductor's builds take",
    "torch._dynamo.utils.counters": "core/compile.py compile_count(): graphs compiled in this process",
    "torch._dynamo.utils.compilation_time_metrics": "core/compile.py compile_seconds(): seconds spent compiling "
                                                    "(the run's closing line)",
    "torch.distributed._functional_collectives": "core/parallel/distributed.py only: the collectives dynamo traces",
    "Tensor._version": "core/step.py HostDue, core/tree.py: has a tensor changed in place since it was read",
}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def _files() -> list[Path]:
    return [p for d in SOURCES for p in (REPO / d).rglob("*") if p.suffix == ".py" or p.parent.name == "bin"]


def private_uses() -> set[str]:
    """The private torch names the package's source reaches (the longest attribute chains from ``torch``, imports
    of ``torch`` modules, ``._version`` on anything)."""
    found = set()
    for path in _files():
        tree = ast.parse(path.read_text(), str(path))
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "_version":
                found.add("Tensor._version")
            elif isinstance(node, ast.Attribute) and id(node) not in inner:
                name = _dotted(node)
                if name and name.startswith("torch.") and _private(name):
                    found.add(name)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("torch.") and _private(a.name)}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                found |= {f"{node.module}.{a.name}" for a in node.names if _private(f"{node.module}.{a.name}")}
    # a chain through a listed private module counts as that module (what is called on it: tests below)
    modules = [n for n in PRIVATE if not n.startswith(("torch._foreach", "Tensor."))]
    return {next((m for m in modules if n.startswith(m + ".")), n) for n in found}


def test_the_inventory_is_complete():
    found = private_uses()
    assert found - set(PRIVATE) == set(), "private torch API used but not checked here: add it to PRIVATE " \
                                          "with a test, or use a public API"
    assert set(PRIVATE) - found == set(), "listed here but no longer used: remove it"


def _lists(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 5, generator=g) for _ in range(n)], [torch.rand(4, 5, generator=g) + 0.5 for _ in range(n)]


def test_foreach_ops_equal_their_per_tensor_forms():
    xs, ys = _lists()
    close = torch.testing.assert_close
    for got, want in [
        (torch._foreach_norm(xs, 2), [torch.linalg.vector_norm(x) for x in xs]),
        (torch._foreach_norm(xs, 2, dtype=torch.float64), [torch.linalg.vector_norm(x.double()) for x in xs]),
        (torch._foreach_add(xs, ys), [x + y for x, y in zip(xs, ys)]),
        (torch._foreach_add(xs, ys, alpha=-0.5), [x - 0.5 * y for x, y in zip(xs, ys)]),
        (torch._foreach_div(xs, ys), [x / y for x, y in zip(xs, ys)]),
        (torch._foreach_div(xs, 3.0), [x / 3.0 for x in xs]),
        (torch._foreach_mul(xs, ys), [x * y for x, y in zip(xs, ys)]),
        (torch._foreach_mul(xs, [torch.tensor(2.0)] * 3), [x * 2 for x in xs]),
        (torch._foreach_sqrt(ys), [y.sqrt() for y in ys]),
    ]:
        assert len(got) == len(want)
        for g, w in zip(got, want):
            close(g, w)
    for op, ref, arg in [(torch._foreach_add_, lambda x, a: x + a, 1.5), (torch._foreach_div_, lambda x, a: x / a, ys),
                         (torch._foreach_mul_, lambda x, a: x * a, ys),
                         (torch._foreach_sign_, lambda x, a: x.sign(), None),
                         (torch._foreach_add_, lambda x, a: x + a, [0.5, 1.0, 2.0])]:
        fresh = [x.clone() for x in xs]
        versions = [x._version for x in fresh]
        op(fresh, *([] if arg is None else [arg]))
        for i, (f, x) in enumerate(zip(fresh, xs)):
            a = arg[i] if isinstance(arg, list) else arg
            close(f, ref(x, a))
        assert all(f._version > v for f, v in zip(fresh, versions)), op   # in place
    dst = [torch.zeros(4, 5) for _ in xs]
    torch._foreach_copy_(dst, xs)
    for d, x in zip(dst, xs):
        assert torch.equal(d, x)


def test_tensor_version_counts_in_place_writes_only():
    t = torch.zeros(3)
    v = t._version
    _ = t + 1
    assert t._version == v
    t.add_(1)
    assert t._version == v + 1
    t[0] = 5
    assert t._version == v + 2


def test_inductor_config_and_mode_options():
    import torch._inductor.config as inductor_config
    from torch._inductor import list_mode_options
    for key in ("fx_graph_cache", "cpp_wrapper", "cpp_wrapper_build_separate"):
        assert hasattr(inductor_config, key), key
    assert inductor_config.aot_inductor.compile_wrapper_opt_level in ("O0", "O1", "O2", "O3")
    import torch._functorch.config as functorch_config          # the AOT-autograd cache core.compile relies on
    assert functorch_config.enable_autograd_cache is True
    assert hasattr(inductor_config.cpp, "enable_kernel_profile")
    for mode in ("default", "reduce-overhead", "max-autotune"):
        assert isinstance(list_mode_options(mode), dict), mode
    assert inductor_config.fx_graph_cache is True or os.environ.get("TORCHINDUCTOR_FX_GRAPH_CACHE") == "0"
    from purestep.core.compile import CACHEABLE, SEPARATE_WRAPPER_BUILD, _compile_kwargs
    assert _compile_kwargs("default", cpp=True) == {"options": {
        **list_mode_options("default"), "unsafe_marked_cacheable_functions": CACHEABLE, "cpp_wrapper": True,
        **dict(SEPARATE_WRAPPER_BUILD)}}


def test_objects_build_together_then_link(tmp_path):
    """``core.cpu_compiles.build_objects_together`` (the purestep program's opt-in) puts its own
    ``_worker_compile_cpp`` in inductor's ``codecache`` (once): a graph's object files build at once (each fake build
    below waits at a barrier for the other, so one after another would time out), the existing one is skipped, the
    link comes last; a list of one (a precompiled header) goes to inductor's own worker, which builds it."""
    from torch._inductor import codecache
    from purestep.core.cpu_compiles import build_objects_together
    assert build_objects_together() and build_objects_together()
    worker = codecache._worker_compile_cpp
    assert worker.builds_objects_together and codecache.LOCK_TIMEOUT > 0
    import inspect
    assert list(inspect.signature(worker).parameters) == ["lock_path", "cpp_builders"]
    barrier, built = threading.Barrier(2, timeout=60), []

    class Builder:
        def __init__(self, name, waits=False):
            self.path, self.waits = tmp_path / name, waits

        def get_target_file_path(self):
            return str(self.path)

        def build(self):
            if self.waits:
                barrier.wait()
            built.append(self.path.name)
            self.path.write_text("")

    (tmp_path / "old.o").write_text("")
    worker(str(tmp_path / "a.lock"), (Builder("main.o", True), Builder("kernels.o", True), Builder("old.o"),
                                      Builder("lib.so")))
    assert sorted(built[:2]) == ["kernels.o", "main.o"] and built[2:] == ["lib.so"]
    worker(str(tmp_path / "b.lock"), (Builder("header.gch"),))
    assert built[3:] == ["header.gch"]


def test_the_vector_isa_probe_runs_once_in_a_thread_of_its_own():
    """``core.cpu_compiles.probe_vector_isa`` starts inductor's probes in a daemon thread, or nothing where this
    process already knows the answer; the ISA it finds is the one inductor picks."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa, valid_vec_isa_list
    from purestep.core.cpu_compiles import probe_vector_isa
    thread = probe_vector_isa()
    if thread is not None:
        assert thread.daemon and thread.name == "purestep-vector-isa-probe"
        thread.join(600)
    assert probe_vector_isa() is None
    valid = [str(isa) for isa in valid_vec_isa_list()]
    assert (str(pick_vec_isa()) in valid) if valid else not pick_vec_isa()


TORCH_AS_FOUND = """
import os, threading
import torch
import torch._dynamo.config as dynamo_config
import torch._functorch.config as functorch_config
import torch._inductor.codecache as codecache
import torch._inductor.config as inductor_config

def torch_state():
    return ({k: v for k, v in vars(codecache).items() if callable(v)}, inductor_config.get_config_copy(),
            dict(inductor_config.unsafe_marked_cacheable_functions), dynamo_config.get_config_copy(),
            functorch_config.get_config_copy(), {k: v for k, v in os.environ.items() if k.startswith("TORCH")})

before, threads = torch_state(), set(threading.enumerate())
from purestep import optim
from purestep.core.state import init_state
from purestep.core.step import make_train_step
from purestep.core.update import Monitors
from purestep.models import llama
from purestep.optim.health import GradientHealth
cfg = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2)
opt, params = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=1e-3)), llama.init(cfg, seed=0)
health = GradientHealth(params, clip_norm=1.0, every=2)          # a torch.cond in the one graph
step = make_train_step(lambda p, b: llama.loss(p, b, cfg), opt, compile=True, donate=True,
                       monitors=Monitors(extra_metrics=health))
state, x = init_state(params, opt), torch.randint(0, 64, (2, 17))
for _ in range(3):
    state, metrics = step(state, {"x": x[:, :-1], "y": x[:, 1:]})
assert torch.isfinite(metrics["loss"]) and int(state.step) == 3
after = torch_state()
names = ("codecache's functions", "inductor's config", "unsafe_marked_cacheable_functions", "dynamo's config",
         "functorch's config", "TORCH* environment variables")
changed = [name for name, a, b in zip(names, before, after) if a != b]
def code_of(thread):          # the module a thread runs: its target's, or its class's
    return getattr(getattr(thread, "_target", None), "__module__", None) or type(thread).__module__
ours = sorted(t.name for t in set(threading.enumerate()) - threads if t.is_alive() and code_of(t).startswith("purestep"))
print(changed, ours)
from torch._dynamo.utils import counters
torch._dynamo.reset()             # the same step compiled again, as a new process would: inductor's cache or not
counters.clear()
state, metrics = step(state, {"x": x[:, :-1], "y": x[:, 1:]})
print(dict(counters["inductor"]))
"""


@pytest.fixture(scope="module")
def fresh_process():
    """The output of ``TORCH_AS_FOUND`` in a child process (a library user's: no ``PURESTEP_CPU_COMPILES``), on the
    session's inductor cache: its last two lines."""
    env = {k: v for k, v in os.environ.items() if k != "PURESTEP_CPU_COMPILES"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", TORCH_AS_FOUND], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-2:]


def test_a_compiled_train_step_leaves_torch_as_a_fresh_process_has_it(fresh_process):
    """Importing purestep, building a train step (compiled with the C++ wrapper, donated, gradient health's
    ``torch.cond`` in its graph) and running it changes nothing of torch in the process: every function in
    inductor's ``codecache``, inductor's, dynamo's and functorch's config and the cacheable-ops table are what they
    were, no ``TORCH*`` variable is set and no thread of purestep's is left behind (inductor's own, tqdm's progress
    monitor, may be). The step's inductor options (``core.compile``) go to ``torch.compile`` itself."""
    assert fresh_process[0] == "[] []", fresh_process


def test_compile_count_reads_dynamos_counter():
    from purestep.core.compile import compile_count
    before = compile_count()
    f = torch.compile(lambda x: x * 2 + 1, fullgraph=True, dynamic=False, backend="eager")
    f(torch.ones(3))
    f(torch.ones(3))
    assert compile_count() - before == 1
    f(torch.ones(4))                                  # a new shape: one more graph
    assert compile_count() - before == 2


def test_compile_seconds_reads_dynamos_timers():
    from purestep.core.compile import COMPILE_TIMERS, compile_seconds
    from torch._dynamo.utils import compilation_time_metrics
    before = compile_seconds()
    f = torch.compile(lambda x: x * 3 - 1, fullgraph=True, dynamic=False, backend="eager")
    f(torch.ones(5))
    assert compile_seconds() > before
    assert COMPILE_TIMERS[0] in compilation_time_metrics


def test_graphs_with_torch_cond_hit_inductors_cache(fresh_process):
    """``torch.cond`` (gradient health's gate in the one-graph train step) is a higher-order op inductor bypasses
    its caches for unless marked cacheable (``core.compile.CACHEABLE``, one of the options ``maybe_compile`` passes to
    ``torch.compile``): the step of ``TORCH_AS_FOUND``, compiled again after ``torch._dynamo.reset()``, reads the FX
    graph cache."""
    counts = eval(fresh_process[1])
    assert counts.get("fxgraph_cache_bypass", 0) == 0 and counts.get("fxgraph_cache_hit", 0) >= 1, counts


def test_functional_collectives_on_one_rank(tmp_path):
    """``core.parallel.distributed``'s four functional collectives (the steps' only collectives) on a 1-rank gloo group
    in a child process (a process group in this process would outlive the test), eager and compiled. Two ranks
    and their numbers: ``tests/test_fsdp.py``, ``tests/test_scale.py``."""
    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from purestep.core.parallel.distributed import all_gather, all_reduce_sum, reduce_scatter_sum, wait
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'pg'}", rank=0, world_size=1)
        group = dist.group.WORLD
        x = torch.arange(6.0)
        def all_four(x):
            return [wait(t) for t in (all_reduce_sum(x, group), all_gather(x, group), reduce_scatter_sum(x, group))]
        for fn in (all_four, torch.compile(all_four, fullgraph=True, backend="eager")):
            for got in fn(x):
                assert torch.equal(got, x), got
        dist.destroy_process_group()
        print("ok")
    """)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", script], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_functional_collectives_have_one_home():
    """Only ``core/parallel/distributed.py`` imports the functional collectives (the names it reaches on the installed
    torch are what ``test_functional_collectives_on_one_rank`` runs)."""
    importers = [str(p.relative_to(REPO)) for p in _files()
                 if any(isinstance(n, (ast.Import, ast.ImportFrom)) and "_functional_collectives" in ast.dump(n)
                        for n in ast.walk(ast.parse(p.read_text())))]
    assert importers == ["core/parallel/distributed.py"]
