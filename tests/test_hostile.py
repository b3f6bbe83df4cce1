"""Hostile inputs (issue 49): a run folder belongs to its run, untrusted files and templates are bounded, a diverged
run is not a success, and every bad input is one ``error:`` line. Each test is one of the issue's reproductions with
its documented outcome; the data-loss ones assert every original file's bytes afterwards."""
import shutil
from pathlib import Path

import pytest

from purestep.core.cli.runs import claim
from purestep.recipes import main

FIXTURE = Path(__file__).parent / "fixtures" / "behaviour" / "step_000000030.msgpack"   # a char-level tiny run


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def first_error(capsys, *args: str, code: int = 2) -> str:
    """The one line ``main(args)`` writes to stderr, an ``error:`` (after the data's tokenizing progress, if any)."""
    assert main(list(args)) == code
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("purestep: tokeniz")]
    assert lines and lines[0].startswith("error: ") and len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def run_folder(tmp_path):
    """A run folder as training leaves it: a checkpoint, metrics.jsonl and its .lock."""
    folder = tmp_path / "cc2"
    folder.mkdir()
    shutil.copy(FIXTURE, folder / "step_000000050.msgpack")
    (folder / "metrics.jsonl").write_text('{"step": 50, "loss": 2.5}\n')
    (folder / ".lock").write_text("pid 1 on host h\n")
    return folder


def test_export_refuses_a_live_run_folder_and_leaves_every_byte(run_folder, capsys):
    with claim(run_folder):                      # the running job's lock: flock, as a second process holds it
        before = snapshot(run_folder)
        message = first_error(capsys, "recipe=export", f"init={FIXTURE}", f"out={run_folder}", "overwrite=true",
                              "verify=false")
        assert "in use by a run" in message and "pid " in message
        assert snapshot(run_folder) == before
    message = first_error(capsys, "recipe=export", f"init={FIXTURE}", f"out={run_folder}", "overwrite=true",
                          "verify=false")                      # no live holder: its files still are not export's
    assert ".lock" in message and snapshot(run_folder) == before
    assert sorted(p.name for p in run_folder.parent.iterdir()) == ["cc2"]     # no temporary left


def test_export_refuses_init_inside_out(run_folder, capsys):
    (run_folder / ".lock").unlink()
    shutil.copy(FIXTURE, run_folder / "final.msgpack")
    before = snapshot(run_folder)
    message = first_error(capsys, "recipe=export", f"init={run_folder / 'final.msgpack'}", f"out={run_folder}",
                          "overwrite=true")
    assert "inside out=" in message and snapshot(run_folder) == before
    message = first_error(capsys, "recipe=export", f"init={run_folder}", f"out={run_folder}", "overwrite=true")
    assert "inside out=" in message and snapshot(run_folder) == before


def needs_hf():
    """Skip unless the 'hf' extra is installed: an HF export writes safetensors and a tokenizer.json."""
    for name in ("safetensors", "tokenizers"):
        pytest.importorskip(name, reason="needs the 'hf' extra: pip install purestep[hf]")


def test_export_overwrite_replaces_an_earlier_export_only(tmp_path, capsys):
    needs_hf()
    out = tmp_path / "hf"
    assert main(["recipe=export", f"init={FIXTURE}", f"out={out}", "verify=false"]) == 0
    first = snapshot(out)
    assert "model.safetensors" in first and "config.json" in first
    (out / "config.json").write_text("{}")
    assert main(["recipe=export", f"init={FIXTURE}", f"out={out}", "verify=false", "overwrite=true"]) == 0
    assert snapshot(out) == first                                # replaced: the same files as the first export
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert "notes.txt" in first_error(capsys, "recipe=export", f"init={FIXTURE}", f"out={out}", "overwrite=true")
    assert (out / "notes.txt").read_text() == "mine" and snapshot(out).keys() == {*first, "notes.txt"}


TINY = ["recipe=standard", "preset=tiny", "compile=false", "block_size=32", "batch_size=4", "model.d_model=32",
        "model.n_layers=1", "model.n_heads=2", "sample_tokens=0", "eval_batches=1", "warmup_steps=0", "log_every=5",
        "save_every=0", "steps=40", "lr=1e30"]


@pytest.mark.usefixtures("token_cache")
@pytest.mark.parametrize("keys, reason", [
    (["spike.enabled=false"], "diverged: the weights' global norm is inf at step 5"),      # reproduction 5
    (["spike.consecutive=1000"], "diverged: the last 29 steps up to step 30 were all non-finite and skipped"),
])
def test_a_diverged_run_stops_with_exit_4_and_is_never_final(corpus, tmp_path, capsys, keys, reason):
    """lr=1e30: step 1 throws the weights to ~1e30 (their norm overflows), every later step is non-finite and
    skipped. With the detector off the log's weight check stops the run at the first pull; with a detector that
    never flags a hard spike the skip count does, after max_skipped_steps=25 (at the pull of step 30: 29 in a
    row). Either way exit 4, stopped.msgpack, no final."""
    from purestep.core.io import checkpoint as ckpt
    out = tmp_path / "run"
    assert main([*TINY, *keys, f"data={corpus}", f"out={out}"]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert (out / ckpt.STOPPED).exists() and not (out / ckpt.FINAL).exists()
    assert err[-1].startswith(f"stopped: {reason}") and err[-1].endswith("not final.msgpack"), err[-1]
    assert ckpt.read_meta(out / ckpt.STOPPED)["stopped"].startswith(reason)


@pytest.mark.usefixtures("token_cache")
def test_one_skipped_step_is_ridden_out(corpus, tmp_path, capsys):
    """A single NaN batch is skipped and the run finishes: the check counts steps in a row, not any skip."""
    from purestep.core.io import checkpoint as ckpt
    out = tmp_path / "run"
    assert main([*TINY[:-1], "steps=12", "lr=1e-3", "spike.enabled=false", "max_skipped_steps=1",
                 "fault.inject_nan_at=3", f"data={corpus}", f"out={out}"]) == 0
    assert "1 non-finite step(s) up to step 5 were skipped" in capsys.readouterr().err and (out / ckpt.FINAL).exists()


HOSTILE_TEMPLATES = {
    "a loop too long": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "a loop over a string": "{% set s = 'a' * 100000 %}{% for x in s %}{% for y in s %}{% endfor %}{% endfor %}",
    "a repeat": "{{ 'a' * 10**12 }}",
    "a format width": "{{ '{:>1000000000000}'.format('a') }}",
    "doubling": "{% set ns = namespace(x='a') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
    "an include": "{% include 'other.jinja' %}",
    "an import": "{% from 'other.jinja' import m %}{{ m() }}",
    "a macro calling itself": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "nesting": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    needs_hf()
    out = tmp_path_factory.mktemp("hostile-hf") / "hf"
    assert main(["recipe=export", f"init={FIXTURE}", f"out={out}", "verify=false"]) == 0
    return out


@pytest.mark.parametrize("what", list(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_is_one_error_line_within_its_budget(hf_folder, what, capsys, monkeypatch):
    """An HF folder's chat_template is a program from the internet: a render is bounded in time (here 0.3 s, by
    default core.data.sandbox.RENDER_SECONDS) and size, and include/import have nothing to load."""
    import json
    import time
    import purestep.core.data.sandbox
    from purestep import core
    monkeypatch.setattr(core.data.sandbox, "RENDER_SECONDS", 0.3)
    conf = json.loads((hf_folder / "tokenizer_config.json").read_text())
    (hf_folder / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": HOSTILE_TEMPLATES[what]}))
    capsys.readouterr()
    start = time.monotonic()
    message = first_error(capsys, "recipe=generate", f"init={hf_folder}", "chat=true", "prompt=hello",
                          "max_new_tokens=2")
    assert message.startswith(f"error: {hf_folder}: chat template") and time.monotonic() - start < 5, message


RUN = ["recipe=standard", "preset=tiny", "compile=false", "steps=2", "sample_tokens=0", "eval_batches=1",
       "tokenizer=byte"]


@pytest.mark.usefixtures("token_cache")
@pytest.mark.parametrize("name, content, says", [
    ("chats.jsonl.gz", b'{"text": "not gzipped"}\n', "not a readable gzip file"),
    ("cut.jsonl.gz", None, "not a readable gzip file"),
    ("deep.jsonl", b"[" * 100_000 + b"]" * 100_000 + b"\n", ":1: JSON nested deeper"),
])
def test_a_bad_jsonl_file_is_one_error_naming_it(tmp_path, capsys, name, content, says):
    import gzip
    path = tmp_path / name
    path.write_bytes(content if content is not None else gzip.compress(b'{"text": "hello there"}\n' * 500)[:-12])
    message = first_error(capsys, *RUN, f"data={path}", f"out={tmp_path / 'run'}")
    assert str(path) in message and says in message, message


@pytest.mark.usefixtures("token_cache")
@pytest.mark.parametrize("key", ["batch_size=99999999999999999999", "block_size=99999999999"])
def test_an_absurd_batch_is_one_error_naming_the_key(corpus, tmp_path, capsys, key):
    message = first_error(capsys, *RUN, key, f"data={corpus}", f"out={tmp_path / 'run'}")
    assert key in message and "GiB" in message and "lower it" in message, message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_max_new_tokens_beyond_memory_is_one_error(capsys):
    message = first_error(capsys, "recipe=generate", f"init={FIXTURE}", "max_new_tokens=100000000000")
    assert "max_new_tokens=100000000000 (a KV cache of 100,000,000,001 positions)" in message, message


def test_ctrl_c_during_start_up_is_one_line_and_130(tmp_path, corpus):
    import signal
    import subprocess
    import sys
    import time
    repo = Path(__file__).resolve().parents[1]
    # as from a terminal: SIGINT at its default (a shell's background job, as `cmd &` starts CI, inherits it ignored)
    proc = subprocess.Popen([sys.executable, str(repo / "bin" / "run"), *RUN, f"data={corpus}", f"out={tmp_path}"],
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.5)                          # inside `import torch`
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "interrupted\n", err


def chunked_claim(path: Path, claim: int) -> Path:
    """A checkpoint whose one chunked array claims ``claim`` float32 elements and holds one 4-byte chunk."""
    import msgpack
    from purestep.core.io import checkpoint_format as fmt
    chunk = msgpack.ExtType(1, msgpack.packb(([1], "float32", b"\0\0\0\0")))
    array = {fmt.CHUNKED: True, "shape": {"0": claim}, "chunks": {"0": chunk}}
    path.write_bytes(msgpack.packb({"format": fmt.FORMAT, "step": 0, "state": {"params": {"w": array}}}))
    return path


@pytest.mark.parametrize("claim", [10**14, 2**28])
def test_a_checkpoint_claiming_more_than_it_holds_is_refused_before_allocating(tmp_path, claim):
    from purestep.core.io import checkpoint_format as fmt
    path = chunked_claim(tmp_path / "bomb.msgpack", claim)
    for state in ("load", "check"):
        with pytest.raises(fmt.CheckpointError, match="truncated: the file ends at byte"):
            fmt.read(path, state=state)


def test_a_string_claiming_more_than_the_file_holds_is_refused(tmp_path):
    from purestep.core.io import checkpoint_format as fmt
    path = tmp_path / "s.msgpack"
    path.write_bytes(b"\x81\xdb\xff\xff\xff\xf0")          # a map whose key claims a 4 GiB string
    with pytest.raises(fmt.CheckpointError, match="truncated"):
        fmt.read(path)


def test_generate_from_a_checkpoint_bomb_is_one_error_line(tmp_path, capsys):
    message = first_error(capsys, "recipe=generate", f"init={chunked_claim(tmp_path / 'b.msgpack', 10**14)}")
    assert "b.msgpack" in message and "truncated" in message, message


def test_a_vars_chain_expanding_exponentially_is_one_error(tmp_path, capsys):
    """Ten vars each ten copies of the next: 10**10 characters if built (it was a MemoryError); refused at the
    cap (core.cli.config_files.MAX_EXPANSION) instead, as is a chain of lists, five copies a step."""
    names = "abcdefghijk"
    ref = {a: "${" + a + "}" for a in names}
    text = "".join(f'{a} = "{ref[b] * 10}"\n' for a, b in zip(names[:9], names[1:10]))
    (tmp_path / "bomb.toml").write_text(f'name = "${{a}}"\n[vars]\n{text}j = "xxxxxxxxxx"\n')
    lists = "".join(f'{a} = [{", ".join([repr(ref[b])] * 5)}]\n' for a, b in zip(names[:10], names[1:]))
    (tmp_path / "lists.toml").write_text(f'name = "${{a}}"\n[vars]\n{lists}k = 1\n')
    for name in ("bomb.toml", "lists.toml"):
        message = first_error(capsys, "recipe=standard", f"config={tmp_path / name}")
        assert "[vars] expand to more than 1,048,576 characters" in message and name in message, message


@pytest.mark.usefixtures("token_cache")
@pytest.mark.parametrize("planted", ["metrics.jsonl", "events.out.tfevents.1.host.1.0", ".lock"])
def test_a_run_never_writes_through_a_planted_symlink(corpus, tmp_path, capsys, planted):
    """Reproduction 7: a link in the run folder to a file outside it; the run refuses it, the target's bytes stay."""
    target = tmp_path / "outside.txt"
    target.write_bytes(b"fifteen bytes..")
    out = tmp_path / "run"
    out.mkdir()
    (out / planted).symlink_to(target)
    message = first_error(capsys, *RUN, f"data={corpus}", f"out={out}")
    assert f"{out / planted} is a symbolic link" in message and target.read_bytes() == b"fifteen bytes..", message


def test_reports_replace_a_planted_symlink_and_leave_its_target(tmp_path):
    """Reports, charts and CSVs are written by rename (core.io.cache.write_file): a link at the name is replaced,
    never written through; an append (core.io.cache.open_append) refuses it."""
    from purestep.core.config import UserError
    from purestep.core.io.cache import open_append, write_csv, write_text
    target = tmp_path / "outside.txt"
    target.write_text("mine")
    for name in ("results.md", "summary.csv", "log.jsonl"):
        (tmp_path / name).symlink_to(target)
    write_text(tmp_path / "results.md", "# report\n")
    write_csv(tmp_path / "summary.csv", [["a", "b"], [1, 2.5]])
    with pytest.raises(UserError, match="log.jsonl is a symbolic link"):
        open_append(tmp_path / "log.jsonl")
    assert target.read_text() == "mine" and (tmp_path / "log.jsonl").is_symlink()
    assert (tmp_path / "results.md").read_text() == "# report\n" and not (tmp_path / "results.md").is_symlink()
    assert (tmp_path / "summary.csv").read_bytes() == b"a,b\r\n1,2.5\r\n"      # as csv.writer to a file gave


def test_a_key_given_twice_on_the_command_line_is_an_error_naming_it(tmp_path, capsys):
    """bin/run's own command line refuses a repeat (reproduction 9); code composing arguments lays a later key over
    an earlier one (recipes.main in-process, core.cli.command.merge_args for a child's command line)."""
    import subprocess
    import sys
    from purestep.core.cli.command import merge_args
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "bin" / "run"), "recipe=standard", "steps=1", "steps=2"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == ("error: key 'steps' is given twice (steps=1 and steps=2); "
                                                    "give it once\n"), proc.stderr
    assert main(["recipe=standard", "steps=1", "steps=2"], repeats=False) == 2
    assert "'steps' is given twice" in capsys.readouterr().err
    assert merge_args("recipe=x", "steps=1", "lr=2", "steps=3") == ["recipe=x", "lr=2", "steps=3"]


def test_a_full_width_digit_is_not_a_number(capsys):
    assert first_error(capsys, "recipe=standard", "steps=\uff15") == "error: bad value for 'steps': '\uff15' is not an int"


@pytest.mark.usefixtures("token_cache")
def test_jsonl_training_with_a_hostile_template_is_one_error_line(hf_folder, tmp_path, capsys, monkeypatch):
    """The same bounded render tokenizes JSONL chats with the init model's template (reproduction 3's second half)."""
    import json
    import purestep.core.data.sandbox
    from purestep import core
    monkeypatch.setattr(core.data.sandbox, "RENDER_SECONDS", 0.3)
    conf = json.loads((hf_folder / "tokenizer_config.json").read_text())
    (hf_folder / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template":
                                                                 HOSTILE_TEMPLATES["a loop too long"]}))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}) + "\n")
    capsys.readouterr()
    message = first_error(capsys, *RUN[:-1], f"init={hf_folder}", f"data={chats}", f"out={tmp_path / 'run'}")
    assert message.startswith(f"error: {chats}:1: chat template: SecurityError: the template ran longer than its "
                              f"0.3 s"), message


@pytest.mark.parametrize("skipped_at, stops_at", [(range(1, 41), 30), (range(5, 10), None)])
def test_the_blockwise_log_stops_a_phase_whose_steps_are_all_skipped(tmp_path, skipped_at, stops_at):
    """Upcycle's blockwise phase logs through its own hook, with the same check (max_skipped_steps=25): every step
    skipped stops it unfinished at the pull of step 30 (30 in a row); five skipped steps in a row do not."""
    from types import SimpleNamespace
    import torch
    from purestep.core.io.logging import Logger
    from purestep.recipes.train.hooks import Run, StepContext
    from purestep.recipes.train.loop import LoopState
    from purestep.recipes.upcycle.blockwise import BlockConvergence
    state = SimpleNamespace(monitor={"blocks": {"active": torch.ones(2, dtype=torch.bool)}}, step=torch.tensor(0))
    with Logger(tmp_path, tensorboard=False, console=False) as logger:
        hook = BlockConvergence(state, 40, 10, logger, max_skipped=25)
        ctx = StepContext(state, 0, 0, run=Run(40, LoopState()))
        for step in range(1, 41):
            ctx.advance(state, {"loss": torch.tensor(1.0), "block_loss": torch.ones(2), "ema": torch.ones(2),
                                "active": torch.ones(2), "lr": torch.tensor(1e-3),
                                "skipped": torch.tensor(float(step in skipped_at))})
            stop = hook.after_step(ctx)
            if stop is not None and stop.unfinished:
                break
    assert (step if stop.unfinished else None) == stops_at and stop is not None
    if stops_at:
        assert stop.reason == ("diverged: the last 30 steps up to step 30 were all non-finite and skipped "
                               "(max_skipped_steps=25)")
