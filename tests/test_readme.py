"""The README stays true: its research script runs as written, its key tables match the code, and every command
in its shell blocks is run by a test (scaled down by key overrides) or listed here with the reason it cannot be."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from core.config_help import markdown_table
from recipes import RECIPES

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def block(name: str) -> str:
    match = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", README, re.S)
    assert match, f"README has no {name} block"
    return match.group(1)


def test_research_script_runs_verbatim(tmp_path):
    script = re.search(r"```python\n(.*?)```", block("research-script"), re.S).group(1)
    assert len(script.strip().splitlines()) <= 40
    env = {**os.environ, "PURESTEP_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    val = float(re.search(r"validation loss (\d+\.\d+)", proc.stdout).group(1))
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5 and val < 4.0, proc.stdout


@pytest.mark.parametrize("recipe", ["standard"])
def test_key_table_matches_the_code(recipe):
    import importlib
    expected = markdown_table(importlib.import_module(RECIPES[recipe]).Config)
    assert block(f"keys:{recipe}").strip() == expected.strip(), \
        f"README key table for {recipe} is stale; replace it with:\n{expected}"


def test_every_recipe_is_in_the_recipes_table():

    table = README.split("## Recipes", 1)[1].split("\n## ", 1)[0]
    assert [name for name in RECIPES if f"| `{name}` |" not in table] == []


# Every command of the README's shell blocks (``bash`` blocks, and ``$ `` lines of transcripts), by its first
# words: the test that runs it at test size, or why none does. Commands run by tests/test_default_paths.py are
# its README_RUNS (read from the README there, so a broken command fails that test).
RUN_ELSEWHERE = {
    "pip install -e . && bin/run recipe=standard": ".ci/run part 1, verbatim, in a new venv",
    'pip install -e ".[test]" && python -m pytest -q': ".ci/run part 1, verbatim, in a new venv",
    "bin/run recipe=standard --help": "tests/test_readme.py::test_help_lists_every_key",
    "bin/run recipe=standard config=my_run.toml lr=3e-4": "tests/test_cli.py::test_later_arguments_win",
    "bin/run recipe=standard init=smollm2 data=chats.jsonl loss_on=assistant":
        "tests/test_jsonl_runs.py::test_smollm2_learns_a_made_up_fact_from_chats",
    "bin/run recipe=generate init=runs/standard-<timestamp> chat=true":
        "tests/test_jsonl_runs.py::test_smollm2_learns_a_made_up_fact_from_chats",
    "bin/run recipe=bench.export init=smollm2":
        "tests/test_export.py::test_bench_export_fine_tunes_exports_and_measures",
    "bin/run recipe=standard name=spot cost_per_hour=1.2 budget=50":
        "tests/test_scale.py::test_telemetry_in_tensorboard_and_budget_stop",
    "bin/run config=stages.toml name=progressive":
        "tests/test_scale.py::test_two_stage_config_continues_from_the_first_stage",
    "torchrun --standalone --nproc_per_node=2 bin/run recipe=standard preset=tiny parallel=fsdp steps=20":
        "tests/test_fsdp.py::test_two_sharded_ranks_equal_one_process_and_checkpoints_move_between_rank_counts",
    "bin/run recipe=standard preset=tiny compile=false name=look cost_per_hour=1.2 dry_run=true":
        "tests/test_dry_run.py::test_dry_run_prints_the_plan_and_creates_no_run_folder",
    "bin/run recipe=standard data=shakespeare.txt name=lr preset=tiny seed=1,2 grid.lr=1e-3,3e-3 grid.parallel=2":
        "tests/test_grid.py::test_parallel_cells_run_as_subprocesses_and_a_failed_cell_resumes_after_the_fix",
}
NOT_RUN = {
    "tensorboard --logdir runs": "a server that runs until stopped (the event files it reads: tests/test_board.py)",
    "python - <<'PY'": "writes a 1 GB corpus (the streaming tokenizer at test size: tests/test_jsonl.py)",
    "/usr/bin/time -v python -c": "tokenizes that 1 GB corpus for minutes (tests/test_jsonl.py at test size)",
    "mkdir -p ~/pydoc": "downloads a Debian package",
    "bin/run recipe=upcycle teacher=smollm2": "SmolLM2-135M for ~11 minutes and more (the pipeline at test size: "
                                             "tests/test_default_paths.py::test_upcycle_every_phase)",
    "OMP_NUM_THREADS=1 bin/run recipe=upcycle teacher=smollm2": "SmolLM2-135M for ~11 minutes and more",
    "bin/run recipe=distill preset=smollm2": "SmolLM2-135M as the teacher for ~4 minutes (the recipe at test size: "
                                             "tests/test_default_paths.py::test_distill_online_and_from_a_cache)",
    "torchrun --nnodes=2": "two nodes",
    "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bin/run recipe=standard parallel=fsdp":
        "a memory measurement at d=512, 8 layers (the sharded step at test size: tests/test_fsdp.py)",
    "bin/run recipe=standard data=tinyshakespeare.txt tokenizer=char model.vocab_size=32000":
        "a memory measurement at 100M parameters",
    "bin/run recipe=bench.llamacpp": "llama-cpp-python, built from its sdist for many minutes, is not a dependency "
                                     "(the benchmark's own logic without it: tests/test_bench_llamacpp.py)",
    "bin/run recipe=standard data=tinyshakespeare.txt tokenizer=byte preset=tiny steps=500 out=runs/byte-tiny":
        "the model that benchmark runs in llama.cpp (the byte model's GGUF at test size: tests/test_gguf_export.py)",
}


def readme_commands(text: str) -> list[str]:
    """The commands of the README's shell blocks: ``bash`` blocks (continuations joined, comments and heredoc
    bodies dropped) and the ``$ `` lines of unlabelled transcript blocks."""
    found = []
    for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.S | re.M):
        lang, body = match.group(2), match.group(3)
        if lang not in ("bash", ""):
            continue
        heredoc = None
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            if heredoc is not None:
                heredoc = None if line == heredoc else heredoc
                continue
            if lang == "":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            opens = re.search(r"<<'?(\w+)'?", line)
            heredoc = opens.group(1) if opens else None
            found.append(re.sub(r"\s+", " ", line.split("  #")[0]).strip())
    return found


def test_every_readme_command_runs_in_a_test_or_says_why_not():
    from tests.test_default_paths import README_RUNS
    covered = {**{k: f"tests/test_default_paths.py::{v}" for k, v in README_RUNS.items()}, **RUN_ELSEWHERE,
               **NOT_RUN}
    commands = readme_commands(README)
    assert len(commands) > 20
    missing = [c for c in commands if not any(c.startswith(first) for first in covered)]
    assert missing == [], "README commands no test runs: run each (scaled down) in tests/test_default_paths.py " \
                          "or another test, or list it in NOT_RUN with the reason"
    stale = [first for first in covered if not any(c.startswith(first) for c in commands)]
    assert stale == [], "listed here but no longer in the README"


def test_the_tests_named_for_readme_commands_exist():
    import ast
    from tests.test_default_paths import README_RUNS
    named = [*(f"tests/test_default_paths.py::{v}" for v in README_RUNS.values()),
             *(v for v in RUN_ELSEWHERE.values() if v.startswith("tests/"))]
    for ref in named:
        path, name = ref.split("::")
        functions = {n.name for n in ast.walk(ast.parse((REPO / path).read_text())) if isinstance(n, ast.FunctionDef)}
        assert name in functions, ref


def test_help_lists_every_key(capsys):
    from recipes import main
    from recipes.standard import Config
    keys = re.findall(r"^\| `([^`]+)` \|", markdown_table(Config), re.M)
    assert main(["recipe=standard", "--help"]) == 0
    out = capsys.readouterr().out
    assert len(keys) > 50 and [k for k in keys if f"  {k} " not in out] == []
