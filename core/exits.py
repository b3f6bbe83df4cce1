"""The exit codes of ``purestep``, in one table, the outcomes that are neither success nor bad input, and the exit.

``core.cli.command.main`` maps every way a command ends to one of ``CODES``; the exit-code table of
docs/configuration.md is generated from it (``tests/test_exits.py`` compares them). Bad input is
``core.config.UserError`` (exit 2). The two classes here are for runs that did their work but must not count as done:

- :class:`GateFailed`: a finished run whose results miss a quality gate the user set (upcycle's
  ``verify.max_ppl_ratio`` ...); the report is written first. One ``gate failed:`` line, exit 3.
- :class:`Incomplete`: a run that trained and kept its model, but an item after training failed (an upcycle
  benchmark measurement); the rest ran and the reports say what failed. One ``incomplete:`` line, exit 5.
- :class:`RunStopped`: a run that stopped without finishing: it diverged (a non-finite validation loss) or hit
  its rollback cap (``spike.max_rollbacks`` within ``spike.window`` steps, or a spike with nothing to roll back
  to). Its last state is written as ``stopped.msgpack`` (``core.io.checkpoint.STOPPED``), never ``final.msgpack``,
  so a script, a grid (``core.cli.grid``) or a rerun of the same command cannot take it for a finished run. One
  ``stopped:`` line, exit 4; a rerun on the same ``out=`` says the same instead of repeating the run.

The convention (0 done, 2 bad input, 3 gate failed, one code of its own for an unfinished run) follows
``sysexits``' spirit without its numbers: small codes a shell script can test, each with one meaning.
:func:`exit_process` ends ``purestep`` with its code.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading

__all__ = ["DONE", "BUG", "BAD_INPUT", "GATE", "STOPPED", "INCOMPLETE", "INTERRUPTED", "CODES", "EXIT_GATE",
           "EXIT_INCOMPLETE", "GateFailed", "RunStopped", "Incomplete", "markdown_table", "exit_process"]

DONE, BUG, BAD_INPUT, GATE, STOPPED, INCOMPLETE, INTERRUPTED = 0, 1, 2, 3, 4, 5, 130
EXIT_GATE, EXIT_INCOMPLETE = GATE, INCOMPLETE

CODES = {
    DONE: "done: the run finished (or had nothing left to do), or stopped cleanly for the same command to resume "
          "it (preemption, `budget`)",
    BUG: "a bug: the traceback is printed; please report it",
    BAD_INPUT: "bad input: one `error:` line naming the key, file or path and what to do (an unknown key, a value "
               "out of range or not finite, a missing file, an `out=` that cannot be created)",
    GATE: "a quality gate failed: the run finished and wrote its report, but its results miss a threshold you set "
          "(`gate failed:` line)",
    STOPPED: "the run stopped without finishing: it diverged or hit its rollback cap (`stopped:` line); its last "
             "state is `stopped.msgpack`, not `final.msgpack`, a grid marks the cell failed, and a rerun on the same "
             "`out=` says so instead of repeating it",
    INCOMPLETE: "incomplete: the run trained and kept its model, but an item after training failed (a benchmark "
                "measurement, a chart: `incomplete:` line); the rest ran and the reports say what failed; a rerun "
                "measures again without retraining",
    INTERRUPTED: "interrupted: Ctrl-C outside a training loop, or a second one inside it (the first stops a "
                 "training run cleanly with a checkpoint: exit 0)",
}


class GateFailed(Exception):
    """A finished run whose results miss a quality gate the user set: not a bug and not bad input; the report
    is written first. One line, exit code 3 (``GATE``)."""


class Incomplete(Exception):
    """A run that trained and kept its model, but an item after training failed (an upcycle benchmark measurement,
    a chart): reported in one line, the rest ran and the reports are written. One line, exit code 5
    (``INCOMPLETE``)."""


class RunStopped(Exception):
    """A run that stopped without finishing (diverged, repeated rollbacks), its last state written as
    ``stopped.msgpack``; or a rerun on the folder of one. One line, exit code 4 (``STOPPED``)."""


def markdown_table() -> str:
    """The exit-code table of docs/configuration.md (``tests/test_exits.py`` compares them)."""
    rows = "\n".join(f"| {code} | {meaning} |" for code, meaning in CODES.items())
    return f"| exit code | meaning |\n|---|---|\n{rows}"


def exit_process(code: int) -> None:
    """End ``purestep``'s process with ``code`` without CPython's teardown of the interpreter. When a command returns,
    what it wrote is closed (checkpoints atomically, the run log, TensorBoard); what is left is freeing, module by
    module, every object torch, dynamo and inductor made, which after a compiled run takes far longer than leaving
    this way (docs/benchmarks.md, "Whole runs"). The exit handlers still run first (``atexit``: torch's, logging's,
    the thread pools'), and the output streams are flushed. Where a thread that is not a daemon is still alive, the
    ordinary exit, which waits for it, is taken instead."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)
