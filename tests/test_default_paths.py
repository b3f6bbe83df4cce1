"""The users' path: each recipe's default command, run as users run it.

Every test runs ``bin/run`` in a child process, the way the README shows it (``torchrun --standalone
--nproc_per_node=2``, gloo on the CPU, for data parallel and sharded runs), with the recipe's defaults:
``compile=true`` wherever that is the default (standard, distill), the one-graph step, gradient health, the
spike monitor. Only sizes are cut, by key overrides (a later ``key=value`` wins). Commands the README shows are
read from the README itself by their first words (``readme``), so a README command that stops working fails
here; ``tests/test_readme.py`` checks that every command block of the README is run by a test or says why not.

Cost: the children share one inductor cache (``$TORCHINDUCTOR_CACHE_DIR`` as set, else inductor's own folder
for this user) and one token cache, and a single char teacher, trained by the README's standard command, serves
every test that needs a teacher. A compiled train step still compiles in every process (gradient health's
``torch.cond`` keeps it out of inductor's FX graph and AOT-autograd caches), so where two runs do not depend
on each other they run side by side (``concurrently``): one compile holds one core.

Written for issue 31: compiled distillation (two RoPE tables in one graph) and compiled data parallel and FSDP
(``torch.cond`` over aliased gradients) crashed on the default command while every test ran ``compile=false``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / "bin" / "run"
README = (REPO / "README.md").read_text()
TIMEOUT = 900

# Sizes, by key overrides only. A teacher and every standard run: 2 layers of d=64 (the tiny preset's model),
# windows of 32 tokens, 6 steps.
SHORT = ["block_size=32", "batch_size=4", "steps=6", "warmup_steps=2", "eval_every=0", "eval_batches=2", "log_every=3",
         "save_every=0", "sample_tokens=16"]
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", *SHORT]
STUDENT = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", *SHORT]
UPCYCLE = ["preset=ci", "calib_tokens=256", "blockwise.steps=4", "blockwise.log_every=2", "global.steps=4",
           "global.eval_every=2", "global.log_every=2", "benchmark.prompt_tokens=16,32", "benchmark.batches=1",
           "benchmark.repeats=1", "benchmark.new_tokens=2", "benchmark.ppl_contexts=16",
           "benchmark.ppl_tokens=128", "benchmark.passkey_contexts=64", "benchmark.passkey_trials=1"]

# The README commands these tests run (scaled down), by their first words; tests/test_readme.py reads this.
README_RUNS = {
    "bin/run recipe=standard data=shakespeare.txt tokenizer=char name=shakes preset=small": "test_standard",
    "bin/run recipe=generate init=runs/standard-shakes": "test_generate",
    "bin/run recipe=lr_find data=shakespeare.txt tokenizer=char": "test_lr_find",
    "bin/run recipe=distill teacher=runs/standard-shakes data=shakespeare.txt": "test_distill_online_and_from_a_cache",
    "bin/run recipe=distill teacher=smollm2 student=drop_layers": "test_distill_under_torchrun",
    "bin/run recipe=compress teacher=smollm2": "test_compress",
    "bin/run recipe=export init=runs/standard-shakes format=hf": "test_export",
    "bin/run recipe=export init=runs/distill-smol format=gguf": "test_export",
    "bin/run recipe=export init=runs/upcycle-smol/global format=hf": "test_export",
    "torchrun --standalone --nproc_per_node=2 bin/run recipe=standard name=ddp": "test_standard_under_torchrun",
    "torchrun --standalone --nproc_per_node=8 bin/run recipe=standard parallel=fsdp": "test_standard_under_torchrun",
}


def readme(first_words: str) -> list[str]:
    """The README command line that starts with ``first_words``: its arguments after ``bin/run`` (the comment
    dropped, continuation lines joined)."""
    text = README.replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(first_words)]
    assert lines, f"the README has no command starting with {first_words!r}"
    words = shlex.split(lines[0], comments=True)
    return words[words.index("bin/run") + 1:]


def torchrun() -> list[str]:
    """``torchrun`` of this interpreter (the script beside it; its module where the script is not on disk)."""
    script = Path(sys.executable).parent / "torchrun"
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


class Runs:
    """Runs ``bin/run`` in a work folder (``runs/`` lands there, as in the README), with one token cache."""

    def __init__(self, work: Path):
        self.work = work
        self.env = {**os.environ, "PURESTEP_CACHE": str(work / ".cache")}

    def __call__(self, *args: str, ranks: int = 1, expect: int = 0) -> subprocess.CompletedProcess:
        launcher = [sys.executable] if ranks == 1 else [*torchrun(), "--standalone", f"--nproc_per_node={ranks}"]
        proc = subprocess.run([*launcher, str(BIN), *args], cwd=self.work, env=self.env, capture_output=True,
                              text=True, timeout=TIMEOUT)
        assert proc.returncode == expect, (f"bin/run {' '.join(args)}{f' on {ranks} ranks' if ranks > 1 else ''}: "
                                           f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        return proc


def concurrently(*calls):
    """Each ``(function, args...)`` in a thread of its own (each starts a child process); their results, in
    order. A failure is raised after all have finished."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(fn, *args) for fn, *args in calls]
    return [f.result() for f in futures]


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def work(tmp_path_factory, corpus) -> Path:
    """The work folder: ``shakespeare.txt`` there is ~200 KB of this Python's standard library source with the
    digits removed, so the char teacher, like tiny shakespeare's, cannot spell a number."""
    folder = tmp_path_factory.mktemp("users")
    text = corpus.read_text().translate(str.maketrans("", "", "0123456789"))
    (folder / "shakespeare.txt").write_text(text)
    return folder


@pytest.fixture(scope="module")
def run(work) -> Runs:
    return Runs(work)


@pytest.fixture(scope="module")
def shakes(run, work) -> subprocess.CompletedProcess:
    """The README's standard command, compiled as by default: the char teacher of the other tests."""
    return run(*readme("bin/run recipe=standard data=shakespeare.txt tokenizer=char name=shakes"), *SMALL)


def test_standard(shakes, work):
    out = output(shakes)
    assert "compile=True" in out and "val loss" in out
    assert (work / "runs" / "standard-shakes" / "final.msgpack").exists()


def test_generate(shakes, run):
    proc = run(*readme("bin/run recipe=generate init=runs/standard-shakes"), "max_new_tokens=24")
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout) > len("ROMEO:")


def test_lr_find(run, work):
    run(*readme("bin/run recipe=lr_find data=shakespeare.txt tokenizer=char"), "model.d_model=32",
        "model.n_layers=1", "batch_size=4", "block_size=32", "num_steps=8", "name=lr")
    rows = (work / "runs" / "lr_find-lr" / "lr_find.csv").read_text().splitlines()
    assert rows[0] == "lr,loss,smoothed_loss" and len(rows) > 2


@pytest.fixture(scope="module")
def byte_teacher(run) -> str:
    """A byte-level teacher (eager, a few steps: a teacher is an input here, not the path under test)."""
    run("recipe=standard", "data=shakespeare.txt", "tokenizer=byte", *SMALL, "compile=false", "sample_tokens=0",
        "out=runs/teacher-byte")
    return "runs/teacher-byte"


@pytest.fixture(scope="module")
def bpe_teacher(run, work) -> str:
    """A teacher with a byte-level BPE ``tokenizer.json`` trained on the work text (``tokenizers``: the hf extra)."""
    tokenizers = pytest.importorskip("tokenizers", reason="a BPE tokenizer needs the 'hf' extra: "
                                                          "pip install purestep[hf]")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([(work / "shakespeare.txt").read_text()], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(work / "tokenizer.json"))
    run("recipe=standard", "data=shakespeare.txt", "tokenizer=tokenizer.json", *SMALL, "compile=false",
        "sample_tokens=0", "out=runs/teacher-bpe")
    return "runs/teacher-bpe"


@pytest.fixture(scope="module")
def distilled(shakes, byte_teacher, run):
    """The README's distill command (online teacher, compiled) beside a teacher cache and the distill run that
    reads it (the byte teacher, so that its student exports to GGUF), the two side by side."""
    command = readme("bin/run recipe=distill teacher=runs/standard-shakes data=shakespeare.txt")

    def from_cache():
        run("recipe=distill_cache", f"teacher={byte_teacher}", "data=shakespeare.txt", "out=cache", "steps=6",
            "batch_size=4", "block_size=32", "k=8")
        return run(*command, *STUDENT, f"teacher={byte_teacher}", "cache=cache", "name=smol")

    return concurrently((run, *command, *STUDENT, "name=online"), (from_cache,))


def test_distill_online_and_from_a_cache(distilled, work):
    online, cached = distilled
    for proc, name in ((online, "online"), (cached, "smol")):
        assert "compile=True" in output(proc)
        assert (work / "runs" / f"distill-{name}" / "final.msgpack").exists()


@pytest.fixture(scope="module")
def upcycled(shakes, run, work, request):
    """``upcycle(kind)``: the upcycle command on the char, byte or BPE teacher, through every phase, each kind
    once for the module: its run folder and the finished process."""
    done = {}

    def upcycle(kind: str):
        if kind not in done:
            teacher = {"char": "runs/standard-shakes"}.get(kind) or request.getfixturevalue(f"{kind}_teacher")
            proc = run("recipe=upcycle", f"teacher={teacher}", "data=shakespeare.txt", *UPCYCLE, f"name={kind}")
            done[kind] = (work / "runs" / f"upcycle-{kind}", proc)
        return done[kind]

    return upcycle


@pytest.mark.parametrize("kind", ["char", "byte", "bpe"])
def test_upcycle_every_phase(kind, upcycled):
    """The char teacher's vocabulary has no digits (as tiny shakespeare's): the passkey benchmark must still run
    (issue 31: it ended a run that had trained)."""
    folder, proc = upcycled(kind)
    for phase in ("surgery", "blockwise", "global"):
        assert (folder / phase / "final.msgpack").exists(), phase
    results = json.loads((folder / "benchmark" / "results.json").read_text())
    assert {c["model"] for c in results["cells"]} == {"teacher", "student"}


def test_compress(shakes, run, work):
    run(*readme("bin/run recipe=compress teacher=smollm2"), "teacher=runs/standard-shakes",
        "data=shakespeare.txt", "sweep=8,16", "train_tokens=2048", "val_tokens=512", "block_size=32",
        "batch_size=4", "steps=6", "warmup_steps=1", "eval_every=3")
    rows = (work / "runs" / "compress-smollm2-sweep" / "summary.csv").read_text().splitlines()
    assert len(rows) == 3


def test_export(distilled, upcycled, run, work):
    for module in ("safetensors", "gguf", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"exports need the 'hf' extra ({module}): pip install purestep[hf]")
    folder, _ = upcycled("byte")
    (work / "runs" / "upcycle-smol").symlink_to(folder)    # the README's name for an upcycle run
    for words, check in (("bin/run recipe=export init=runs/standard-shakes format=hf", "config.json"),
                         ("bin/run recipe=export init=runs/distill-smol format=gguf", "*.gguf"),
                         ("bin/run recipe=export init=runs/upcycle-smol/global format=hf", "config.json")):
        args = readme(words)
        proc = run(*args)
        out = work / next(a.split("=", 1)[1] for a in args if a.startswith("out="))
        assert list(out.glob(check)), (words, sorted(p.name for p in out.iterdir()))
        assert "verified with" in output(proc) or "not verified" in output(proc)


def test_orchestrator_on(shakes, run, work):
    """The orchestrator switched on over the compiled standard run, with a decision (one challenger) inside it."""
    proc = run(*readme("bin/run recipe=standard data=shakespeare.txt tokenizer=char name=shakes"), *SMALL,
               "steps=10", "name=orchestrated", "orchestrator.enabled=true",
               "orchestrator.portfolio=adamw,conservative_adamw", "orchestrator.decision_interval=4",
               "orchestrator.eval_horizon=2", "orchestrator.min_gap=0", "orchestrator.probe_batches=1")
    assert "compile=True" in output(proc)
    rows = (work / "runs" / "standard-orchestrated" / "orchestrator.jsonl").read_text().splitlines()
    assert rows and (work / "runs" / "standard-orchestrated" / "final.msgpack").exists()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_standard_under_torchrun(parallel, run, work):
    words = {"ddp": "torchrun --standalone --nproc_per_node=2 bin/run recipe=standard name=ddp",
             "fsdp": "torchrun --standalone --nproc_per_node=8 bin/run recipe=standard parallel=fsdp"}[parallel]
    proc = run(*readme(words), "data=shakespeare.txt", "tokenizer=char", *SMALL, "batch_size=2",
               f"name={parallel}", ranks=2)
    assert "compile=True" in output(proc) and f"parallel: {parallel} over 2 ranks" in output(proc)
    assert (work / "runs" / f"standard-{parallel}" / "final.msgpack").exists()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_distill_under_torchrun(parallel, shakes, run, work):
    """ddp: the README's first distill command; fsdp: its second (every other teacher layer, symmetric KL, a
    learnable temperature), each with the char teacher."""
    if parallel == "ddp":
        args = [*readme("bin/run recipe=distill teacher=runs/standard-shakes data=shakespeare.txt"), *STUDENT]
    else:
        args = [*readme("bin/run recipe=distill teacher=smollm2 student=drop_layers"), "teacher=runs/standard-shakes",
                "data=shakespeare.txt", *SHORT]
    proc = run(*args, "batch_size=2", f"parallel={parallel}", f"name={parallel}", ranks=2)
    assert "compile=True" in output(proc) and f"parallel: {parallel} over 2 ranks" in output(proc)
    assert (work / "runs" / f"distill-{parallel}" / "final.msgpack").exists()


def test_upcycle_global_phase_under_fsdp(shakes, run, work):
    proc = run("recipe=upcycle", "teacher=runs/standard-shakes", "data=shakespeare.txt", *UPCYCLE,
               "phases=global", "global.batch_size=2", "parallel=fsdp", "name=fsdp", ranks=2)
    assert "parallel: fsdp over 2 ranks" in output(proc)
    assert (work / "runs" / "upcycle-fsdp" / "global" / "final.msgpack").exists()
