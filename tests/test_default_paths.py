"""The users' path: each recipe's default command, run as users run it.

Every test runs ``bin/run`` in a child process, the way the README shows it (``torchrun --standalone
--nproc_per_node=2``, gloo on the CPU, for data parallel and sharded runs), with the recipe's defaults:
``compile=true`` wherever that is the default (standard, distill), the one-graph step, gradient health, the
spike monitor. Only sizes are cut, by key overrides (a later ``key=value`` wins: ``merge_args``, since bin/run refuses
a key given twice). Commands the README and its
docs/ pages show are read from those pages by their first words (``readme``), so a documented command that stops
working fails here; ``tests/test_readme.py`` checks that every command block of them is run by a test or says why
not.

Cost. The children share one inductor cache (``$TORCHINDUCTOR_CACHE_DIR`` as set, else inductor's own folder for
this user) and one token cache, and one char teacher, trained by the README's standard command, serves every test
that needs a teacher. A compiled train step comes from the cache when a run of the same shapes and keys compiled it
before (gradient health's ``torch.cond`` is marked cacheable, ``core.compile.CACHEABLE``): the orchestrated and
diverging runs wait for ``shakes`` and the data-parallel runs for their one-process twins, at the same rows per
rank. One compile keeps one core busy, so the runs are jobs (``JOBS``, those of the selected tests) started together
when the session starts (``start``, called by ``tests/conftest.py``, which also puts this module's tests last):
while the other tests run (on one intra-op thread, mostly one core busy), one core fewer than the machine has runs
them (a 2-rank torchrun counts as one there), and once this module's tests begin, one per core (a 2-rank torchrun
takes two), so the jobs are mostly done when the tests ask. A test waits for its own. Each job's time is printed
when the module ends (a test's own duration is mostly waiting).

Written for issue 31: compiled distillation (two RoPE tables in one graph) and compiled data parallel and FSDP
(``torch.cond`` over aliased gradients) crashed on the default command while every test ran ``compile=false``.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import documentation
from purestep.core.cli.command import merge_args
from purestep.core.io import checkpoint as ckpt
from purestep.core.parallel.distributed import cpu_tensor_parallel_refusal
from purestep.core.tree import max_abs_diff

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / "bin" / "run"
README = documentation.text()       # README.md, then docs/*.md
TIMEOUT = 1200
CORES = max(1, min(os.cpu_count() or 1, 4))

# Sizes, by key overrides only: one layer of d=64 for every compiled model (a compile's cost grows with the
# graph), 32-token windows, 6 steps.
SHORT = ["block_size=32", "batch_size=4", "steps=6", "warmup_steps=2", "eval_every=0", "eval_batches=2", "log_every=3",
         "save_every=0", "sample_tokens=16"]
SMALL = ["model.d_model=64", "model.n_layers=1", "model.n_heads=4", *SHORT]
STUDENT = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", *SHORT]
# The runs whose sharded twins must end where they end (issue 51: 20 steps); the number of steps is a constant of
# the compiled step (the schedule's span), so the runs that share their graphs take it too.
TWENTY = ["steps=20", "log_every=5"]
UPCYCLE = ["preset=ci", "calib_tokens=256", "blockwise.steps=4", "blockwise.log_every=2", "global.steps=4",
           "global.eval_every=2", "global.log_every=2", "benchmark.prompt_tokens=16,32", "benchmark.batches=1",
           "benchmark.repeats=1", "benchmark.new_tokens=2", "benchmark.ppl_contexts=16",
           "benchmark.ppl_tokens=128", "benchmark.passkey_contexts=64", "benchmark.passkey_trials=1"]

STANDARD = "purestep recipe=standard data=shakespeare.txt tokenizer=char name=shakes preset=small"
DISTILL = "purestep recipe=distill teacher=runs/standard-shakes data=shakespeare.txt"
DISTILL_DROP = "purestep recipe=distill teacher=smollm2 student=drop_layers"
DISTILL_GKD = "purestep recipe=distill teacher=runs/standard-shakes data=shakespeare.txt kl=jsd beta=0.5 on_policy=0.5"
DISTILL_HIDDEN = ("purestep recipe=distill teacher=runs/standard-shakes data=shakespeare.txt model.d_model=64 "
                  "model.n_layers=2 hidden=")
DDP = "torchrun --standalone --nproc_per_node=2 -m purestep recipe=standard name=ddp"
FSDP = "torchrun --standalone --nproc_per_node=8 -m purestep recipe=standard parallel=fsdp"
FSDP_TP = "torchrun --standalone --nproc_per_node=4 -m purestep recipe=standard parallel=fsdp,tp mesh=dp:2,tp:2"
EXPORTS = {"purestep recipe=export init=runs/standard-shakes format=hf": "config.json",
           "purestep recipe=export init=runs/distill-smol format=gguf": "*.gguf",
           "purestep recipe=export init=runs/upcycle-smol/global format=hf": "config.json"}

# The README commands these tests run (scaled down), by their first words; tests/test_readme.py reads this.
README_RUNS = {
    STANDARD: "test_standard",
    "purestep recipe=generate init=runs/standard-shakes": "test_generate",
    "purestep recipe=lr_find data=shakespeare.txt tokenizer=char": "test_lr_find",
    DISTILL: "test_distill_online_and_from_a_cache",
    DISTILL_DROP: "test_distill_under_torchrun",
    DISTILL_GKD: "test_distill_on_policy_jsd",
    DISTILL_HIDDEN: "test_distill_hidden_targets",
    "purestep recipe=compress teacher=smollm2": "test_compress",
    **{words: "test_export" for words in EXPORTS},
    DDP: "test_standard_under_torchrun",
    FSDP: "test_standard_under_torchrun",
    FSDP_TP: "test_tensor_parallel_standard_equals_one_process_compiled",
}


def readme(first_words: str) -> list[str]:
    """The first command line of README.md and docs/*.md that starts with ``first_words``: its arguments after
    ``bin/run`` (the comment dropped, continuation lines joined)."""
    text = README.replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(first_words)]
    assert lines, f"README.md and docs/*.md have no command starting with {first_words!r}"
    words = shlex.split(lines[0], comments=True)
    return words[words.index("purestep") + 1:]


def torchrun() -> list[str]:
    """``torchrun`` of this interpreter (the script beside it; its module where the script is not on disk)."""
    script = Path(sys.executable).parent / "torchrun"
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def label(args) -> str:
    """A run's words that tell it from the others (the last of each key wins, as in ``bin/run``)."""
    words = dict(a.split("=", 1) for a in args if "=" in a)
    return " ".join(f"{k}={words[k]}" for k in ("recipe", "name", "out", "format", "parallel") if k in words)


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


class Runs:
    """``bin/run`` in the work folder (``runs/`` lands there, as in the README), one token cache for all, at most
    ``slots`` processes at a time in the order asked (``widen`` raises it); and the module's jobs (``JOBS``), each
    run once, in threads of their own."""

    def __init__(self, work: Path, slots: int):
        self.work = work
        self.env = {**os.environ, "PURESTEP_CACHE": str(work / ".cache")}
        self.slots, self.free, self.cores, self.queue = slots, slots, threading.Condition(), []
        self.pool = ThreadPoolExecutor(max_workers=4 * len(JOBS))   # waiting on a job holds a thread, not a core
        self.futures: dict = {}
        self.lock = threading.Lock()
        self.times: list[str] = []

    def __call__(self, *args: str, ranks: int = 1, expect: int = 0) -> subprocess.CompletedProcess:
        launcher = [sys.executable] if ranks == 1 else [*torchrun(), "--standalone", f"--nproc_per_node={ranks}"]
        ticket = object()
        with self.cores:                                # first come, first served: a torchrun is not starved
            self.queue.append(ticket)
            self.cores.wait_for(lambda: self.queue[0] is ticket and self.free >= min(ranks, self.slots))
            self.queue.pop(0)
            need = min(ranks, self.slots)
            self.free -= need
            self.cores.notify_all()
        started = time.monotonic()
        try:
            # a documented command plus overrides, each key once (bin/run refuses a repeat; the later one wins)
            proc = subprocess.run([*launcher, str(BIN),
                                   *merge_args(*args)], cwd=self.work, env=self.env, capture_output=True,
                                  text=True, timeout=TIMEOUT)
        finally:
            ranked = f" on {ranks} ranks" if ranks > 1 else ""
            self.times.append(f"{time.monotonic() - started:6.1f}s  {label(args)}{ranked}")
            with self.cores:
                self.free += need
                self.cores.notify_all()
        assert proc.returncode == expect, (f"bin/run {' '.join(args)}{f' on {ranks} ranks' if ranks > 1 else ''}: "
                                           f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        return proc

    def widen(self, slots: int) -> None:
        with self.cores:
            self.free += max(0, slots - self.slots)
            self.slots = max(slots, self.slots)
            self.cores.notify_all()

    def start(self, name: str):
        with self.lock:
            if name not in self.futures:
                self.futures[name] = self.pool.submit(JOBS[name], self)
            return self.futures[name]

    def get(self, name: str):
        """Job ``name``'s result (started now if it was not), or its exception (a skip included)."""
        return self.start(name).result()


JOBS = {}


def job(fn):
    """A run (or a chain of them) that tests and other jobs ``get`` by the function's name."""
    JOBS[fn.__name__] = fn
    return fn


@job
def shakes(run):
    """The README's standard command, compiled as by default: the char teacher of the other jobs."""
    return run(*readme(STANDARD), *SMALL, *TWENTY)


@job
def standard_muon(run):
    """The standard command with ``optimizer=muon`` (issue 35), compiled, its eval step too (``eval_compile=true``: the
    one-process eval graph; a short run's ``auto`` leaves it eager); then a resume of its folder that asks for AdamW,
    refused by name (the optimizer state's layout differs)."""
    words = [*readme(STANDARD), *SMALL, "optimizer=muon", "eval_compile=true", "out=runs/standard-muon"]
    return run(*words), run(*words, "optimizer=adamw", "steps=8", expect=2)


@job
def standard_diverging(run):
    """The standard command at ``lr=6e29``, compiled: every step's loss blows up, the spike monitor rolls back to its
    in-memory snapshot until its cap, and the run stops (``core.exits``: exit 4). After ``shakes``, with its keys and
    its ``min_lr / lr`` (the schedule's floor, a constant of the graph), so its step comes from the cache."""
    run.get("shakes")
    return run(*readme(STANDARD), *SMALL, *TWENTY, "lr=6e29", "min_lr=6e28", "out=runs/diverging", expect=4)


@job
def byte_teacher(run):
    """A byte-level teacher of two layers (eager: a teacher is an input here, not the path under test)."""
    run("recipe=standard", "data=shakespeare.txt", "tokenizer=byte", *SMALL, "model.n_layers=2", "compile=false",
        "sample_tokens=0", "out=runs/teacher-byte")
    return "runs/teacher-byte"


@job
def bpe_teacher(run):
    """A teacher with a byte-level BPE ``tokenizer.json`` trained on the work text (``tokenizers``: the hf extra)."""
    tokenizers = pytest.importorskip("tokenizers", reason="a BPE tokenizer needs the 'hf' extra: "
                                                          "pip install purestep[hf]")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([(run.work / "shakespeare.txt").read_text()], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(run.work / "tokenizer.json"))
    run("recipe=standard", "data=shakespeare.txt", "tokenizer=tokenizer.json", *SMALL, "model.n_layers=2",
        "compile=false", "sample_tokens=0", "out=runs/teacher-bpe")
    return "runs/teacher-bpe"


@job
def generate(run):
    run.get("shakes")
    return run(*readme("purestep recipe=generate init=runs/standard-shakes"), "max_new_tokens=24")


@job
def lr_find(run):
    return run(*readme("purestep recipe=lr_find data=shakespeare.txt tokenizer=char"), "model.d_model=32",
               "model.n_layers=1", "batch_size=4", "block_size=32", "num_steps=8", "name=lr")


@job
def distill_online(run):
    run.get("shakes")
    return run(*readme(DISTILL), *STUDENT, "name=online")


@job
def distill_gkd(run):
    """GKD's generalized JSD on half-student-written rows (docs/distill.md's command), compiled: the on-policy rows
    are data of the one compiled step (``recipes.distill.on_policy``)."""
    run.get("shakes")
    return run(*readme(DISTILL_GKD), *STUDENT, "name=gkd")


@job
def distill_hidden(run):
    """docs/distill.md's hidden-state targets, compiled: the student (d=32) through a learned projection onto the
    teacher's states (d=64)."""
    run.get("shakes")
    return run(*readme(DISTILL_HIDDEN), *STUDENT, "hidden=1:1", "name=hidden")


@job
def distill_cached(run):
    """A teacher cache of the byte teacher (so that the student exports to GGUF), then the distill run on it."""
    teacher = run.get("byte_teacher")
    run("recipe=distill_cache", f"teacher={teacher}", "data=shakespeare.txt", "out=cache", "steps=6",
        "batch_size=4", "block_size=32", "k=8")
    return run(*readme(DISTILL), *STUDENT, f"teacher={teacher}", "cache=cache", "name=smol")


def _upcycle(run, kind: str, teacher: str):
    return run("recipe=upcycle", f"teacher={teacher}", "data=shakespeare.txt", *UPCYCLE, f"name={kind}")


@job
def upcycle_char(run):
    run.get("shakes")
    return _upcycle(run, "char", "runs/standard-shakes")


@job
def upcycle_byte(run):
    return _upcycle(run, "byte", run.get("byte_teacher"))


@job
def upcycle_bpe(run):
    return _upcycle(run, "bpe", run.get("bpe_teacher"))


@job
def compress(run):
    run.get("shakes")
    return run(*readme("purestep recipe=compress teacher=smollm2"), "teacher=runs/standard-shakes",
               "data=shakespeare.txt", "sweep=8,16", "train_tokens=2048", "val_tokens=512", "block_size=32",
               "batch_size=4", "steps=6", "warmup_steps=1", "eval_every=3")


@job
def export(run):
    """The README's three exports: the standard run to HF, the cached distill's byte-level student to GGUF, the
    byte teacher's upcycled DBA student to HF (remote code)."""
    for module in ("safetensors", "gguf", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"exports need the 'hf' extra ({module}): pip install purestep[hf]")
    run.get("shakes"), run.get("distill_cached"), run.get("upcycle_byte")
    (run.work / "runs" / "upcycle-smol").symlink_to(run.work / "runs" / "upcycle-byte")   # the README's name
    return [run(*readme(words)) for words in EXPORTS]


@job
def orchestrated(run):
    """The orchestrator switched on over the compiled standard run, with a decision (one challenger) in it (after
    ``shakes``, whose shapes it has: its compile reuses that run's cached graphs)."""
    run.get("shakes")
    return run(*readme(STANDARD), *SMALL, "steps=10", "name=orchestrated", "orchestrator.enabled=true",
               "orchestrator.portfolio=adamw,conservative_adamw", "orchestrator.decision_interval=4",
               "orchestrator.eval_horizon=2", "orchestrator.min_gap=0", "orchestrator.probe_batches=1")


@job
def standard_ddp(run):
    """After ``shakes``, with its rows per rank."""
    run.get("shakes")
    return run(*readme(DDP), "data=shakespeare.txt", "tokenizer=char", *SMALL, "name=ddp", ranks=2)


@job
def standard_fsdp(run):
    """The README's FSDP command on 2 ranks of ``shakes``' rows split in two (the whole sharded step one graph, as
    ``compile_scope=auto`` compiles a 1-layer model), its eval step compiled too (``eval_compile=true``: a short
    run's ``auto`` leaves it eager, and this is where the sharded eval graph is compiled)."""
    return run(*readme(FSDP), "data=shakespeare.txt", "tokenizer=char", *SMALL, *TWENTY, "batch_size=2",
               "name=fsdp", "eval_compile=true", ranks=2)


@job
def standard_fsdp4(run):
    """The same on 4 ranks of one row each, compiled block by block (``compile_scope=block``: the layers gathered one
    at a time and prefetched, ``core.parallel.shard_blocks``)."""
    return run(*readme(FSDP), "data=shakespeare.txt", "tokenizer=char", *SMALL, *TWENTY, "batch_size=1",
               "compile_scope=block", "name=fsdp4", ranks=4)


@job
def standard_fsdp_tp(run):
    """The README's FSDP command with tensor parallel on a 2x2 mesh: 2 data-parallel ranks of ``shakes``' rows split
    in two, every block's heads and MLP features split over 2 ranks (``compile_scope=auto``: the block compiled)."""
    return run(*readme(FSDP_TP), "data=shakespeare.txt", "tokenizer=char", *SMALL, *TWENTY, "batch_size=2",
               "name=fsdp-tp", ranks=4)


@job
def distill_ddp(run):
    """docs/distill.md's GKD command on 2 ranks (after ``distill_gkd``, with its rows per rank: its graphs come from
    the cache), each rank rolling out rows of its own."""
    run.get("distill_gkd")
    return run(*readme(DISTILL_GKD), *STUDENT, "parallel=ddp", "name=ddp", ranks=2)


@job
def distill_drop(run):
    """The README's second distill command (every other teacher layer, symmetric KL, a learnable temperature) in one
    process, compiled, with the char teacher: what ``distill_fsdp`` must equal."""
    run.get("shakes")
    return run(*readme(DISTILL_DROP), "teacher=runs/standard-shakes", "data=shakespeare.txt", *SHORT, *TWENTY,
               "name=drop")


@job
def distill_fsdp(run):
    """``distill_drop`` sharded over 2 ranks of half its rows each, the teacher too (``teacher_shard=true``: the one
    graph's step takes it gathered whole)."""
    run.get("shakes")
    return run(*readme(DISTILL_DROP), "teacher=runs/standard-shakes", "data=shakespeare.txt", *SHORT, *TWENTY,
               "batch_size=2", "parallel=fsdp", "teacher_shard=true", "name=fsdp", ranks=2)


@job
def upcycle_fsdp(run):
    run.get("shakes")
    return run("recipe=upcycle", "teacher=runs/standard-shakes", "data=shakespeare.txt", *UPCYCLE, "phases=global",
               "global.batch_size=2", "parallel=fsdp", "name=fsdp", ranks=2)


def uses(*names: str):
    """The jobs a test waits for (``{param}`` filled from its parameters): the module starts them all at once."""
    def mark(fn):
        fn.jobs = names
        return fn
    return mark


RUNS = pytest.StashKey[Runs]()


def start(session: pytest.Session, tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Runs:
    """The runner, with the jobs of this module's selected tests started in file order, ``CORES - 1`` at a time
    (``tests/conftest.py`` calls it when the session starts). The work folder's ``shakespeare.txt`` is ``corpus``
    (~200 KB of this Python's standard library source, ``tests/conftest.py``) with the digits removed, so the char
    teacher, like tiny shakespeare's, cannot spell a number."""
    folder = tmp_path_factory.mktemp("users")
    (folder / "shakespeare.txt").write_text(corpus.read_text().translate(str.maketrans("", "", "0123456789")))
    runs = session.config.stash[RUNS] = Runs(folder, slots=max(1, CORES - 1))
    for item in session.items:
        if item.path == Path(__file__):
            params = getattr(getattr(item, "callspec", None), "params", {})
            for name in getattr(item.function, "jobs", ()):
                runs.start(name.format(**params))
    return runs


@pytest.fixture(scope="module")
def run(request, tmp_path_factory):
    """The session's runner (started now if conftest did not), one job per core from here on."""
    runs = request.config.stash.get(RUNS, None) or start(request.session, tmp_path_factory,
                                                         request.getfixturevalue("corpus"))
    runs.widen(CORES)
    yield runs
    runs.pool.shutdown(wait=True, cancel_futures=True)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter and capture and runs.times:
        with capture.global_and_fixture_disabled():          # a fixture's teardown output is captured otherwise
            reporter.write_line(f"\n{request.module.__name__}: each bin/run's time (started with the session)")
            for line in runs.times:
                reporter.write_line(line)


@pytest.fixture(scope="module")
def work(run) -> Path:
    return run.work


@uses("shakes")
def test_standard(run, work):
    out = output(run.get("shakes"))
    assert "compile=True (the eval step eager; inductor options: " in out and "val loss" in out
    assert "cpp_wrapper=True" in out and "unsafe_marked_cacheable_functions={torch.ops.higher_order.cond}" in out
    assert (work / "runs" / "standard-shakes" / "final.msgpack").exists()


@uses("standard_muon")
def test_standard_with_muon(run, work):
    """Muon's learning rate (its shape-based adjustment on top) is logged apart from AdamW's, and is larger."""
    first, again = run.get("standard_muon")
    assert "compile=True (the eval step too; inductor options: " in output(first)
    folder = work / "runs" / "standard-muon"
    top = ckpt.load(folder / "final.msgpack")
    assert math.isfinite(top["val_loss"]) and top["val_loss"] < math.log(256), top["val_loss"]
    lrs = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "muon_lr" in r]
    assert lrs and lrs[-1]["muon_lr"] > 10 * lrs[-1]["lr"]
    assert "optimizer (muon -> adamw)" in again.stderr, again.stderr[-2000:]


@uses("standard_diverging")
def test_standard_at_its_rollback_cap_exits_4(run, work):
    """A diverging run stops after its rollbacks with its last state as ``stopped.msgpack``, never ``final``, and
    says why in its last line (tests/test_exits.py has the eager cases)."""
    err = run.get("standard_diverging").stderr
    assert err.strip().splitlines()[-1].startswith("stopped: 3 rollbacks within 1000 steps"), err[-3000:]
    assert "Traceback" not in err
    folder = work / "runs" / "diverging"
    assert (folder / ckpt.STOPPED).exists() and not (folder / ckpt.FINAL).exists()


@uses("generate")
def test_generate(run):
    out = run.get("generate").stdout
    assert out.startswith("ROMEO:") and len(out) > len("ROMEO:")


@uses("lr_find")
def test_lr_find(run, work):
    run.get("lr_find")
    rows = (work / "runs" / "lr_find-lr" / "lr_find.csv").read_text().splitlines()
    assert rows[0] == "lr,loss,smoothed_loss" and len(rows) > 2


@uses("distill_online", "distill_cached")
def test_distill_online_and_from_a_cache(run, work):
    for name, folder in (("distill_online", "online"), ("distill_cached", "smol")):
        assert "compile=True" in output(run.get(name))
        assert (work / "runs" / f"distill-{folder}" / "final.msgpack").exists()


@uses("distill_gkd")
def test_distill_on_policy_jsd(run, work):
    """The KD term is the JSD (at most log 2 at beta = 0.5) and some of its positions score the student's own
    tokens (issue 36: on_policy=0.5 trains compiled in one process; the 2-rank run is distill_ddp's)."""
    out = output(run.get("distill_gkd"))
    assert "compile=True" in out and "generalized JSD (beta=0.5)" in out and "on-policy (GKD)" in out
    rows = [json.loads(line) for line in (work / "runs" / "distill-gkd" / "metrics.jsonl").read_text().splitlines()]
    kls = [r["kl"] for r in rows if "kl" in r]
    assert kls and all(0 < v < math.log(2) for v in kls)
    assert any(r["on_policy"] > 0 for r in rows if "on_policy" in r)


@uses("distill_hidden")
def test_distill_hidden_targets(run, work):
    out = output(run.get("distill_hidden"))
    assert "compile=True" in out and "hidden-state targets" in out and "32x64 projections" in out
    folder = work / "runs" / "distill-hidden"
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["hidden"] for r in rows if "hidden" in r] and (folder / "final.msgpack").exists()


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
@uses("upcycle_{kind}")
def test_upcycle_every_phase(kind, run, work):
    """The char teacher's vocabulary has no digits (as tiny shakespeare's): the passkey benchmark must still run
    (issue 31: it ended a run that had trained)."""
    run.get(f"upcycle_{kind}")
    folder = work / "runs" / f"upcycle-{kind}"
    for phase in ("surgery", "blockwise", "global"):
        assert (folder / phase / "final.msgpack").exists(), phase
    results = json.loads((folder / "benchmark" / "results.json").read_text())
    assert {c["model"] for c in results["cells"]} == {"teacher", "student"}


@uses("compress")
def test_compress(run, work):
    run.get("compress")
    rows = (work / "runs" / "compress-smollm2-sweep" / "summary.csv").read_text().splitlines()
    assert len(rows) == 3


@uses("export")
def test_export(run, work):
    for (words, written), proc in zip(EXPORTS.items(), run.get("export")):
        out = work / next(a.split("=", 1)[1] for a in readme(words) if a.startswith("out="))
        assert list(out.glob(written)), (words, sorted(p.name for p in out.iterdir()))
        assert "verified with" in output(proc) or "not verified" in output(proc)


@uses("orchestrated")
def test_orchestrator_on(run, work):
    assert "compile=True" in output(run.get("orchestrated"))
    folder = work / "runs" / "standard-orchestrated"
    assert (folder / "orchestrator.jsonl").read_text().splitlines() and (folder / "final.msgpack").exists()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@uses("standard_{parallel}")
def test_standard_under_torchrun(parallel, run, work):
    out = output(run.get(f"standard_{parallel}"))
    assert "compile=True" in out and f"parallel: {parallel} over 2 ranks" in out
    assert ("the eval step too" in out) == (parallel == "fsdp")
    assert (work / "runs" / f"standard-{parallel}" / "final.msgpack").exists()


def same_training(work: Path, one: str, sharded: str, params_within: float = 1e-6) -> None:
    """Two compiled runs (folders under ``work/runs``), one process and its sharded twin with the same global batch:
    every logged train loss and the final params within 1e-6 (issue 51; the params within ``params_within``)."""
    def losses(name):
        rows = map(json.loads, (work / "runs" / name / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    a, b = losses(one), losses(sharded)
    assert len(a) == 4 and a.keys() == b.keys(), (a, b)
    assert max(abs(a[k] - b[k]) for k in a) < 1e-6, (a, b)
    params = [ckpt.load(work / "runs" / name / "final.msgpack")["state"]["params"] for name in (one, sharded)]
    assert max_abs_diff(*params) < params_within


@pytest.mark.parametrize("job", ["standard_fsdp", "standard_fsdp4"])
@uses("shakes", "{job}")
def test_sharded_standard_equals_one_process_compiled(job, run, work):
    """``parallel=fsdp`` compiled on 2 ranks (one graph per step) and on 4 (block by block, prefetching) ends where
    ``shakes`` ends over its 20 steps."""
    ranks = 4 if job.endswith("4") else 2
    out = output(run.get(job))
    assert "compile=True" in out and f"parallel: fsdp over {ranks} ranks" in out
    assert ("gathered per block" in out) == (ranks == 4)
    same_training(work, "standard-shakes", job.replace("_", "-"))


@pytest.mark.skipif(bool(cpu_tensor_parallel_refusal()), reason=cpu_tensor_parallel_refusal())
@uses("shakes", "standard_fsdp_tp")
def test_tensor_parallel_standard_equals_one_process_compiled(run, work):
    """``parallel=fsdp,tp`` on a 2x2 mesh, compiled (the block graph over DTensors), ends where ``shakes`` ends over
    its 20 steps: the losses within 1e-6, the params within 1e-5 (a row-parallel product sums two pieces, and
    rounds apart from the whole one; measured 1.03e-6)."""
    out = output(run.get("standard_fsdp_tp"))
    assert "compile=True" in out and "tensor parallel over 2 ranks" in out
    same_training(work, "standard-shakes", "standard-fsdp-tp", params_within=1e-5)


@uses("distill_drop", "distill_fsdp")
def test_sharded_distill_equals_one_process_compiled(run, work):
    run.get("distill_drop"), run.get("distill_fsdp")
    same_training(work, "distill-drop", "distill-fsdp")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@uses("distill_{parallel}")
def test_distill_under_torchrun(parallel, run, work):
    out = output(run.get(f"distill_{parallel}"))
    assert "compile=True" in out and f"parallel: {parallel} over 2 ranks" in out
    assert (work / "runs" / f"distill-{parallel}" / "final.msgpack").exists()
    if parallel == "fsdp":
        assert "teacher sharded across 2 ranks, gathered whole for every step" in out
    if parallel == "ddp":   # on_policy=0.5: each rank rolled out rows of its own
        rows = [json.loads(line) for line in (work / "runs" / "distill-ddp" / "metrics.jsonl").read_text().splitlines()]
        assert any(r.get("on_policy", 0) > 0 for r in rows)


@uses("upcycle_fsdp")
def test_upcycle_global_phase_under_fsdp(run, work):
    assert "parallel: fsdp over 2 ranks" in output(run.get("upcycle_fsdp"))
    assert (work / "runs" / "upcycle-fsdp" / "global" / "final.msgpack").exists()
