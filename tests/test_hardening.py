"""Hostile input that used to get through: recipe modules from config files, names that leave the run root."""
import pytest

from recipes import main


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
