"""The README and its docs/ pages stay true: the README is a guide of at most 300 lines whose links resolve and reach
every docs/ page, its research script runs as written, the key tables (docs/configuration.md) match the code, and
every command in the shell blocks of any page, and in the README's recipe table, is run by a test (scaled down by
key overrides) or listed here with the reason it cannot be."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import documentation
import installed
from purestep.core.cli.config_help import markdown_table
from purestep.recipes import RECIPES

REPO = documentation.REPO
README = documentation.README.read_text()


def _python_block(name: str) -> str:
    page, text = documentation.block(name)
    assert page == documentation.README, f"the {name} example belongs in the README"
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_research_examples_run_verbatim(tmp_path, installed_site):
    """The README's research script (a step built from the public pieces, compiled and donated from outside) and
    the swap example after it (a custom transform in the chain), run verbatim in one process: purestep installed
    non-editable (``pip install .`` into a folder), run from a project with its own ``models``, ``core`` and ``optim``
    packages, which stay the project's."""
    script, swap = _python_block("research-script"), _python_block("research-swap")
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("grad_fn ="))
    end = next(i for i, line in enumerate(lines) if line.startswith("step = torch.compile("))
    assert end - start + 1 <= 12, "the step from the pieces takes at most 12 lines (the issue's acceptance)"
    assert "core/" not in swap and "import purestep.core." not in swap.replace("from purestep.core.tree", "")
    project = installed.collision_project(tmp_path / "project")
    where = ("\nimport core, models, purestep\n"
             "print('purestep from', purestep.core.__file__, '| models from', models.__file__)\n")
    env = {**os.environ, "PURESTEP_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(installed_site)}
    proc = subprocess.run([sys.executable, "-c", script + swap + where], cwd=project, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert f"purestep from {installed_site / 'purestep' / 'core'}" in proc.stdout, proc.stdout
    assert f"models from {project / 'models'}" in proc.stdout, proc.stdout
    losses = [float(x) for x in re.findall(r"step \d+: loss (\d+\.\d+)", proc.stdout)]
    val = float(re.search(r"validation loss (\d+\.\d+)", proc.stdout).group(1))
    assert losses[0] > 5.0 and losses[-1] < losses[0] - 1.5 and val < 4.0, proc.stdout
    centralized = float(re.search(r"centralized: loss (\d+\.\d+)", proc.stdout).group(1))
    assert centralized < losses[0] - 1.0, proc.stdout


@pytest.mark.parametrize("recipe", ["standard", "eval"])
def test_key_table_matches_the_code(recipe):
    import importlib
    expected = markdown_table(importlib.import_module(RECIPES[recipe]).Config)
    page, table = documentation.block(f"keys:{recipe}")
    assert table.strip() == expected.strip(), \
        f"the key table for {recipe} in {page.relative_to(REPO)} is stale; replace it with:\n{expected}"


def recipes_table() -> str:
    return README.split("\n## Recipes", 1)[1].split("\n## ", 1)[0]


def test_every_recipe_is_in_the_recipes_table():
    assert [name for name in RECIPES if f"| `{name}` |" not in recipes_table()] == []


def test_each_recipe_has_one_documented_command_in_the_table():
    """The recipe table's command of each recipe is a command of a shell block on some page, so the check of
    those commands below covers it too."""
    documented = readme_commands(documentation.text())
    rows = {row.split("`")[1]: row for row in recipes_table().splitlines() if row.startswith("| `")}
    assert set(rows) == set(RECIPES)
    for name, row in rows.items():
        commands = [c for c in re.findall(r"`([^`]*purestep [^`]*)`", row)]
        assert len(commands) == 1 and f"recipe={name} " in f"{commands[0]} ", row
        assert commands[0] in documented, f"{commands[0]!r} is in no shell block of README.md or docs/*.md"


# Every command of the shell blocks of README.md and docs/*.md (``bash`` blocks, and ``$ `` lines of transcripts),
# by its first words: the test that runs it at test size, or why none does. Commands run by
# tests/test_default_paths.py are its README_RUNS (read from these pages there, so a broken command fails that test).
RUN_ELSEWHERE = {
    "torchrun --standalone --nproc_per_node=4 -m purestep recipe=standard parallel=hsdp":
        "tests/test_fsdp.py::test_hybrid_sharding_on_a_2x2_mesh_equals_one_process",
    "pip install -e . && purestep recipe=standard": ".ci/run part 1, verbatim, in a new venv",
    'pip install -e ".[test]" && python -m pytest -q': ".ci/run part 1, verbatim, in a new venv",
    "purestep recipe=standard --help": "tests/test_readme.py::test_help_lists_every_key",
    "purestep recipe=standard config=my_run.toml lr=3e-4": "tests/test_cli.py::test_later_arguments_win",
    "purestep recipe=standard init=smollm2 data=chats.jsonl loss_on=assistant":
        "tests/test_jsonl_runs.py::test_smollm2_learns_a_made_up_fact_from_chats",
    "purestep recipe=generate init=runs/standard-<timestamp> chat=true":
        "tests/test_jsonl_runs.py::test_smollm2_learns_a_made_up_fact_from_chats",
    "purestep recipe=bench.export init=smollm2":
        "tests/test_export.py::test_bench_export_fine_tunes_exports_and_measures",
    "purestep recipe=standard name=spot cost_per_hour=1.2 budget=50":
        "tests/test_scale.py::test_telemetry_in_tensorboard_and_budget_stop",
    "purestep config=stages.toml name=progressive":
        "tests/test_scale.py::test_two_stage_config_continues_from_the_first_stage",
    "torchrun --standalone --nproc_per_node=2 -m purestep recipe=standard preset=tiny parallel=fsdp steps=20":
        "tests/test_fsdp.py::test_two_sharded_ranks_equal_one_process_and_checkpoints_move_between_rank_counts",
    "purestep recipe=standard preset=tiny compile=false name=look cost_per_hour=1.2 dry_run=true":
        "tests/test_dry_run.py::test_dry_run_prints_the_plan_and_creates_no_run_folder",
    "purestep recipe=standard data=shakespeare.txt name=lr preset=tiny seed=1,2 grid.lr=1e-3,3e-3 grid.parallel=2":
        "tests/test_grid.py::test_parallel_cells_run_as_subprocesses_and_a_failed_cell_resumes_after_the_fix",
    "purestep recipe=upcycle teacher=runs/standard-shakes data=shakespeare.txt":
        "tests/test_default_paths.py::test_upcycle_every_phase",
    "purestep recipe=bench.kv": "tests/test_upcycle_bench.py::"
                               "test_bench_kv_compares_two_checkpoints_and_records_cells_that_do_not_fit",
    "purestep recipe=bench.upcycle": "tests/test_bench_upcycle.py::"
                                    "test_every_arm_starts_from_one_surgery_and_trains_its_budget",
    "purestep recipe=bench.policy": "tests/test_on_policy.py::"
                                   "test_the_policy_bench_scores_a_student_on_its_own_samples_and_on_the_data",
    "purestep recipe=bench.fsdp preset=100m": "tests/test_bench.py::"
                                             "test_fsdp_bench_halves_the_state_on_2_ranks_and_overlaps_the_prefetched_gathers",
    "purestep recipe=bench.gpu device=cpu": "tests/test_bench_gpu.py::test_the_gpu_bench_runs_every_section_on_the_cpu",
    "purestep recipe=export init=STUDENT": "tests/test_mla.py::"
                                          "test_recipe_export_writes_an_mla_checkpoint_in_deepseek_v2s_formats",
    "purestep recipe=eval init=smollm2": "tests/test_eval.py::test_the_default_command_through_bin_run",
    "purestep recipe=bench.nanogpt": "tests/test_bench_nanogpt.py::"
                                    "test_the_bench_runs_both_sides_taking_turns_and_tabulates_them",
    "purestep recipe=eval init=runs/upcycle-smol/global":
        "tests/test_eval.py::test_paired_comparison_of_two_runs_matches_the_hand_formulas",
}
NOT_RUN = {
    "purestep recipe=eval init=runs/mla4x-": "scores SmolLM2's MLA students of the surgery alone, a surgery of minutes "
                                            "each (paired scoring at test size: tests/test_eval.py)",
    "purestep recipe=export init=runs/smol-mla-4x/surgery": "SmolLM2's MLA student, from a surgery of minutes "
                                                         "(the same export at test size: tests/test_mla.py)",
    "tensorboard --logdir runs": "a server that runs until stopped (the event files it reads: tests/test_board.py)",
    "torchrun --standalone --nproc_per_node=2 -m purestep recipe=distill teacher=smollm2 data=tinyshakespeare.txt":
        "SmolLM2 as a sharded teacher, a memory figure (teacher_shard=true at test size: tests/test_fsdp.py)",
    "torchrun --standalone --nproc_per_node=2 -m purestep recipe=standard init=smollm2":
        "SmolLM2 under fsdp, a memory figure (init= under fsdp at test size: tests/test_fsdp.py)",
    "torchrun --standalone --nproc_per_node=4 -m purestep recipe=standard data=tinyshakespeare.txt tokenizer=char":
        "72M params on 4 ranks, a memory figure (fsdp, fsdp,tp and hsdp at test size: tests/test_fsdp.py)",
    "python - <<'PY'": "writes a 1 GB corpus (the streaming tokenizer at test size: tests/test_jsonl.py)",
    "/usr/bin/time -v python -c": "tokenizes that 1 GB corpus for minutes (tests/test_jsonl.py at test size)",
    "mkdir -p ~/pydoc": "downloads a Debian package",
    "purestep recipe=upcycle teacher=smollm2": "SmolLM2-135M for ~11 minutes and more (the pipeline at test size: "
                                             "tests/test_default_paths.py::test_upcycle_every_phase)",
    "OMP_NUM_THREADS=1 purestep recipe=upcycle teacher=smollm2": "SmolLM2-135M for ~11 minutes and more",
    "purestep recipe=export init=runs/smol-up/global": "exports the SmolLM2 student of the upcycle command before it "
                                                      "(the same exports of a tiny student: tests/test_dba_llama.py)",
    "purestep recipe=distill preset=smollm2": "SmolLM2-135M as the teacher for ~4 minutes (the recipe at test size: "
                                             "tests/test_default_paths.py::test_distill_online_and_from_a_cache)",
    "torchrun --nnodes=2": "two nodes",
    "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m purestep recipe=standard parallel=fsdp":
        "a memory measurement at d=512, 8 layers (the sharded step at test size: tests/test_fsdp.py)",
    "purestep recipe=standard data=tinyshakespeare.txt tokenizer=char model.vocab_size=32000":
        "a memory measurement at 100M parameters",
    "purestep recipe=standard data=/work/shared/data/tinyshakespeare.txt tokenizer=char model.n_layers=4":
        "nanoGPT's configuration, 2000 compiled steps timed (Muon at test size: tests/test_default_paths.py::test_standard_with_muon; the AdamW run's "
        "first 800 steps: tests/test_shakespeare.py)",
    "purestep recipe=bench.llamacpp": "llama-cpp-python, built from its sdist for many minutes, is not a dependency "
                                     "(the benchmark's own logic without it: tests/test_bench_llamacpp.py)",
    "purestep recipe=standard data=tinyshakespeare.txt tokenizer=byte preset=tiny steps=500 out=runs/byte-tiny":
        "the model that benchmark runs in llama.cpp (the byte model's GGUF at test size: tests/test_gguf_export.py)",
    "purestep recipe=distill_cache teacher=smollm2": "SmolLM2-135M over 100 batches (a cache at test size: "
                                                    "tests/test_default_paths.py::"
                                                    "test_distill_online_and_from_a_cache)",
    "purestep recipe=bench.step": "compiles every variant cold in processes of its own, for many minutes at 100M (the "
                                 "bench at test size: tests/test_bench.py)",
    "purestep recipe=bench.speed": "interleaved timed rounds for minutes (the bench at test size: tests/test_speed.py)",
    "purestep recipe=bench.wall": "eight whole 2000-step runs, two of them compiling cold (the bench at test size: "
                                 "tests/test_bench.py::test_wall_bench_times_both_whole_runs_per_cache_state)",
    "purestep recipe=bench.health": "a timing (what it times: tests/test_health.py, tests/test_adagc.py; its keys: "
                                   "tests/test_bench.py)",
    "purestep recipe=bench.checkpoint": "writes and reads a 398 MB state a dozen times (checkpoints: "
                                       "tests/test_checkpoint.py, tests/test_checkpoint_integrity.py)",
    "OMP_NUM_THREADS=1 purestep recipe=bench.orchestrator": "300- and 1000-step runs (the unstable run at test size: "
                                                           "tests/test_orchestrator.py)",
    "purestep recipe=bench.distill": "SmolLM2-135M as the teacher (the bench at test size: "
                                    "tests/test_distill.py::test_the_cache_benchmark_command)",
    "purestep recipe=bench.gpu out=gpu-report": "a CUDA machine for about 8 minutes (its CPU mode: "
                                               "tests/test_bench_gpu.py)",
    "purestep recipe=standard data=tinyshakespeare.txt tokenizer=char out=runs/tiny-teacher":
        "600 steps of the quality-per-token table's teacher (char runs at test size: tests/test_shakespeare.py)",
    "pip download --no-deps": "downloads wheels for the GPU machine",
    "purestep recipe=bench.eval": "SmolLM2 through recipe=eval and lm-evaluation-harness's HF backend: ~9 minutes at "
                                 "limit=20, 55 minutes over the six full splits "
                                 "(lm-eval is no dependency; the comparison itself: tests/test_eval.py::"
                                 "test_the_harness_comparison_counts_same_choices_and_the_largest_difference)",
    "python3 -m pip install -q --no-index": "installs those wheels on the GPU machine",
    "export PYTHONPATH=/tmp/site": "the GPU machine's environment",
}


def readme_commands(text: str) -> list[str]:
    """The commands of the shell blocks of ``text`` (the README and its docs/ pages): ``bash`` blocks
    (continuations joined, comments and heredoc bodies dropped) and the ``$ `` lines of unlabelled transcript blocks."""
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
    commands = readme_commands(documentation.text())
    assert len(commands) > 20
    missing = [c for c in commands if not any(c.startswith(first) for first in covered)]
    assert missing == [], "commands of README.md or docs/*.md no test runs: run each (scaled down) in " \
                          "tests/test_default_paths.py or another test, or list it in NOT_RUN with the reason"
    stale = [first for first in covered if not any(c.startswith(first) for c in commands)]
    assert stale == [], "listed here but no longer in README.md or docs/*.md"


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
    from purestep.recipes import main
    from purestep.recipes.standard import Config
    keys = re.findall(r"^\| `([^`]+)` \|", markdown_table(Config), re.M)
    assert main(["recipe=standard", "--help"]) == 0
    out = capsys.readouterr().out
    assert len(keys) > 50 and [k for k in keys if f"  {k} " not in out] == []


# The README is a guide; the reference lives in docs/, reachable from it by links that resolve.
FENCE = re.compile(r"^( *)```.*?^\1```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(page: Path) -> str:
    """A page without its fenced code blocks and inline code (a ``#`` or ``[x](y)`` there is not Markdown)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as ``-``, ``-1``, ``-2`` for repeats."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def links(page: Path) -> list[tuple[str, Path, str]]:
    """The relative links of a page: (as written, the file it names, the anchor or '')."""
    found = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):          # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        found.append((target, (page.parent / path).resolve() if path else page, anchor))
    return found


def test_the_readme_is_a_guide_of_at_most_300_lines_with_the_two_commands_on_its_first_screen():
    lines = README.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference material to docs/"
    first_screen = "\n".join(lines[:24])
    assert "pip install -e . && purestep recipe=standard" in first_screen
    assert 'pip install -e ".[test]" && python -m pytest -q' in first_screen


def broken_links(page: Path) -> list[str]:
    broken = []
    for target, path, anchor in links(page):
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path.name}")
    return broken


@pytest.mark.parametrize("page", documentation.PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == [], page.relative_to(REPO)


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = {documentation.README}, [documentation.README]
    while todo:
        for _, path, _ in links(todo.pop()):
            if path.suffix == ".md" and path.exists() and path not in reached:
                reached.add(path)
                todo.append(path)
    assert [str(p.relative_to(REPO)) for p in documentation.PAGES if p not in reached] == []


def test_the_link_checks_see_a_broken_link_and_a_wrong_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title: one (`x`)\n\n## Again\n\n## Again\n\n```bash\n# not a heading\n```\n"
                                   "[ok](#title-one-x) [ok](#again-1) [bad](#not-a-heading) [gone](b.md) "
                                   "`[code](c.md)` [web](https://example.com)\n")
    assert broken_links(tmp_path / "a.md") == ["#not-a-heading: no heading with anchor #not-a-heading in a.md",
                                               "b.md: no such file"]
