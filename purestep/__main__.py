"""purestep's command line: ``purestep recipe=NAME [config=FILE.toml] [preset=NAME] [key=value ...]`` (also
``python -m purestep``, and ``bin/run`` in a checkout).

A thin click wrapper: every token (``--help`` included) goes to ``purestep.recipes.main``, which parses the
key=value arguments, runs the recipe and turns errors into exit codes. See ``purestep --help``. A Ctrl-C while
torch and the recipes are still being imported is the same one ``interrupted`` line and exit 130
(``core.exits.INTERRUPTED``) as one during the run, not a traceback.
"""
import os
import signal
import sys


def _interrupted():
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)             # core.exits.INTERRUPTED (not yet importable: this is its import being interrupted)


# A Ctrl-C during the imports waits until they are whole: raised inside them, a KeyboardInterrupt can be swallowed by
# a library's import fallback and leave a half-imported module behind (numpy without its functions). Unblocking
# delivers a pending one, which pthread_sigmask raises here.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
try:
    import click

    from purestep.core.exits import exit_process
    from purestep.recipes import main as run_recipe
except KeyboardInterrupt:
    _interrupted()
try:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
except KeyboardInterrupt:
    _interrupted()


@click.command(context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def main(args):
    """The ``purestep`` command (setup.cfg's console script), ``python -m purestep`` and ``bin/run``: the program opts
    its own process into the CPU compile speed-ups (``core.cpu_compiles``; ``PURESTEP_CPU_COMPILES=0`` opts out),
    then runs the recipe."""
    os.environ.setdefault("PURESTEP_CPU_COMPILES", "1")
    exit_process(run_recipe(args, repeats=False))     # a key typed twice is an error naming it


if __name__ == "__main__":
    main()
