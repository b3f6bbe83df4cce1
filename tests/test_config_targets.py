"""Config files' [vars] and [targets.NAME] (core.cli.config_files) and their place in bin/run's precedence:
defaults < preset < config file < target < [[stages]] < command line."""
from __future__ import annotations

import pytest

import fake_recipe
from purestep import recipes
from purestep.core.config import ConfigError
from purestep.core.cli.config_files import load_toml

STUDY = '''
recipe = "fake"
preset = "tiny"
out = "${root}/cfg.json"
steps = "${n}"

[vars]
root = "${base}/study"
base = "/tmp/runs"
n = 40
lr = 0.002

[model]
d_model = 96

[targets.quick]
steps = 5
model.n_layers = 1

[targets.paper]
preset = "small"
lr = "${lr}"
out = "${root}/paper-${n}.json"
[targets.paper.model]
d_model = 512
'''


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(recipes.RECIPES, "fake", "fake_recipe")
    fake_recipe.RUNS.clear()
    return fake_recipe.RUNS


def write(tmp_path, text: str, name: str = "study.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def one_line_error(capsys, argv) -> str:
    assert recipes.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def test_vars_and_two_targets_resolve_to_the_documented_values(fake, tmp_path):
    path = write(tmp_path, STUDY.replace("/tmp/runs", str(tmp_path)))
    (tmp_path / "study").mkdir()                               # the fake recipe writes its config to out=
    base = fake_recipe.Config
    assert recipes.main([f"config={path}"]) == 0               # no target: the file's top level over tiny
    cfg = fake[-1]
    assert (cfg.steps, cfg.lr, cfg.model.n_layers, cfg.model.d_model) == (40, base.lr, 2, 96)
    assert cfg.out == f"{tmp_path}/study/cfg.json"            # a var using a var; "${n}" stayed an int
    assert recipes.main([f"config={path}", "target=quick"]) == 0
    cfg = fake[-1]
    assert (cfg.steps, cfg.model.n_layers, cfg.model.d_model) == (5, 1, 96)     # target over file over preset
    assert recipes.main([f"config={path}", "target=paper"]) == 0
    cfg = fake[-1]                  # preset=small replaces tiny (n_layers 8, no steps: the file's 40 stays)
    assert (cfg.steps, cfg.lr, cfg.model.n_layers, cfg.model.d_model) == (40, 0.002, 8, 512)
    assert cfg.out == f"{tmp_path}/study/paper-40.json"       # a non-string var inside a string
    assert recipes.main([f"config={path}", "target=paper", "model.d_model=8", "preset=tiny"]) == 0
    cfg = fake[-1]                  # the command line beats the target (its preset= too)
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.steps) == (8, 2, 40)


def test_a_file_may_name_its_default_target_and_the_command_line_wins(fake, tmp_path):
    path = write(tmp_path, 'recipe = "fake"\ntarget = "quick"\n[targets.quick]\nsteps = 3\n'
                           '[targets.long]\nsteps = 300\n')
    assert recipes.main([f"config={path}"]) == 0 and fake[-1].steps == 3
    assert recipes.main([f"config={path}", "target=long"]) == 0 and fake[-1].steps == 300


def test_stages_sit_between_the_target_and_the_command_line(fake, tmp_path):
    path = write(tmp_path, 'recipe = "fake"\nlr = 0.1\n[targets.t]\nlr = 0.2\nsteps = 7\n'
                           '[[stages]]\nname = "a"\nlr = 0.3\n[[stages]]\nname = "b"\n')
    (tmp_path / "run").mkdir()          # the fake recipe writes its config as a file named like the stage
    (tmp_path / "run2").mkdir()
    assert recipes.main([f"config={path}", "target=t", f"out={tmp_path / 'run'}"]) == 0
    assert [(c.lr, c.steps) for c in fake] == [(0.3, 7), (0.2, 7)]
    fake.clear()
    assert recipes.main([f"config={path}", "target=t", "lr=0.5", f"out={tmp_path / 'run2'}"]) == 0
    assert [c.lr for c in fake] == [0.5, 0.5]


def test_unknown_target_and_var_are_one_line_errors_naming_them(fake, tmp_path, capsys):
    path = write(tmp_path, STUDY)
    err = one_line_error(capsys, [f"config={path}", "target=papr"])
    assert "unknown target 'papr'" in err and "its targets: quick, paper" in err
    bad = write(tmp_path, STUDY.replace('"${lr}"', '"${rate}"'), "bad.toml")
    assert recipes.main([f"config={bad}", "--help"]) == 0       # the target holding it is not chosen
    err = one_line_error(capsys, [f"config={bad}", "target=paper"])
    assert "unknown var 'rate'" in err and "target paper" in err and "[vars] has root, base" in err
    cyclic = write(tmp_path, 'recipe = "fake"\nout = "${a}"\n[vars]\na = "x${b}"\nb = "${a}"\n', "cyclic.toml")
    err = one_line_error(capsys, [f"config={cyclic}"])
    assert "var 'a' refers to itself (a -> b -> a)" in err
    err = one_line_error(capsys, ["recipe=fake", "target=quick"])
    assert "target=quick needs a config=FILE.toml" in err
    assert fake == []


def test_target_is_reserved_and_may_not_nest_file_tables(tmp_path):
    path = write(tmp_path, '[targets.t]\nstages = 1\n')
    with pytest.raises(ConfigError, match="target t sets 'stages'"):
        load_toml(path, target="t")
    assert load_toml(write(tmp_path, 'out = "$${HOME}/${x}"\n[vars]\nx = true\n', "esc.toml")) == \
        {"out": "${HOME}/true"}
    with pytest.raises(ConfigError, match="it has no \\[targets.NAME\\] tables"):
        load_toml(write(tmp_path, "steps = 1\n", "plain.toml"), target="quick")


def test_the_documented_study_resolves_to_the_values_it_documents(tmp_path):
    import re
    import documentation
    from purestep.core.config import resolve
    from purestep.recipes import standard
    block = re.search(r"```toml\n(.*?)```", documentation.block("study-example")[1], re.S).group(1)
    path = write(tmp_path, block)

    def study(target):
        toml = load_toml(path, target=target)
        assert toml.pop("recipe") == "standard"
        return resolve(standard.Config, presets=standard.PRESETS, toml=toml, context="recipe standard")
    quick, paper = study("quick"), study("paper")
    assert (quick.steps, quick.compile, quick.model.d_model, quick.model.n_layers, quick.out) == \
        (50, False, 64, 2, "runs/study/d64")
    assert (paper.steps, paper.lr, paper.model.d_model, paper.model.n_layers, paper.out) == \
        (5000, 3e-4, 512, 6, "runs/study/d512")
