"""Hostile input that used to get through: recipe modules from config files, names that leave the run root."""
import pytest

from purestep.recipes import main


def test_a_config_file_recipe_must_define_config_and_run_before_it_is_imported(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "mylab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("print('the package ran')\n")
    (pkg / "loud.py").write_text("print('the module ran')\n")
    (pkg / "good.py").write_text("from dataclasses import dataclass\n\n@dataclass\nclass Config:\n    steps: int = 1\n\n"
                                 "def run(cfg):\n    print('good ran', cfg.steps)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for recipe in ("this.nothing", "mylab.loud", "mylab.missing", "no_such_pkg.x", "a..b"):
        path = tmp_path / "exp.toml"
        path.write_text(f'recipe = "{recipe}"\n')
        assert main([f"config={path}"]) == 2, recipe
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("error:") and recipe in err, (recipe, out, err)
    assert main(["recipe=mylab.good", "steps=3"]) == 0             # research recipes by dotted path still work
    assert capsys.readouterr().out.endswith("good ran 3\n")


@pytest.mark.parametrize("args", [["name=../../../x"], ["name=a/b"]])
def test_a_run_name_cannot_leave_runs(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["recipe=standard", "compile=false", "steps=1", *args]) == 2
    assert capsys.readouterr().err.startswith("error: name=")
    assert list(tmp_path.iterdir()) == []


def test_a_stage_name_cannot_leave_the_run_folder(tmp_path, capsys):
    path = tmp_path / "stages.toml"
    path.write_text('recipe = "standard"\n[[stages]]\nname = "../../../x"\nsteps = 1\n')
    assert main([f"config={path}", f"out={tmp_path / 'run'}", "compile=false"]) == 2
    assert capsys.readouterr().err.startswith("error: stages.name=")
    assert not (tmp_path / "run").exists()


def test_a_diverging_run_rolls_back_instead_of_crashing_in_logging(tmp_path, corpus, token_cache, capsys):
    """lr=1e30 made every gradient-health column non-finite: add_histogram raised before the rollback acted."""
    args = ["recipe=standard", "preset=tiny", "compile=false", "sample_tokens=0", "eval_batches=1", f"data={corpus}",
            "steps=20", "save_every=10", "log_every=1", "warmup_steps=0"]
    assert main([*args, "lr=1e30", f"out={tmp_path / 'a'}"]) == 4   # stopped without finishing (core.exits)
    err = capsys.readouterr().err
    assert "rolled back" in err and "rollbacks within" in err and "Traceback" not in err


def test_a_rollback_after_resume_returns_to_the_resumed_step_not_to_step_0(tmp_path, corpus, token_cache, capsys):
    """The ring's starting snapshot was filed under the step rounded down to snapshot_every (0 for a run
    resumed at step 40): a rollback then restarted the step count at 0 with step 40's weights."""
    args = ["recipe=standard", "preset=tiny", "compile=false", "sample_tokens=0", "eval_batches=1", f"data={corpus}",
            "warmup_steps=0", "log_every=1", "spike.warmup=5", f"out={tmp_path}"]
    assert main([*args, "steps=40"]) == 0
    assert main([*args, "steps=60", "lr=1e30", "lr_schedule=constant"]) == 4   # at the rollback cap: stopped
    err = capsys.readouterr().err
    assert "rolled back to step 40" in err and "rolled back to step 0" not in err, err


def test_the_printed_resume_command_survives_a_shell(monkeypatch, tmp_path):
    import subprocess
    import sys

    from purestep.recipes.train.checkpointing import resume_command
    argv = ["recipe=standard", "sample_prompt=it's a b", 'name=x"y', "lr=1e-3"]
    monkeypatch.setattr(sys, "argv", ["bin/run", *argv, "out=old"])
    command = resume_command(tmp_path / "my run")
    shown = subprocess.run(["bash", "-c", f"printf '%s\\n' {command}"], capture_output=True, text=True, check=True)
    assert shown.stdout.splitlines() == ["purestep", *argv, f"out={tmp_path / 'my run'}"]
