"""core.config: key=value overrides parsed against dataclass annotations, strictly."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

import pytest

from purestep.core.config import ConfigError, UserError, apply_overrides, from_dict, option, resolve, to_dict
from purestep.core.cli.config_files import load_toml
from purestep.core.cli.config_help import describe, format_help
from purestep.models.llama import LlamaConfig


@dataclass
class Optim:
    lr: float = option(3e-4, "peak learning rate")
    betas: tuple[float, float] = option((0.9, 0.95), "Adam betas")


@dataclass
class Cfg:
    steps: int = option(100, "optimizer steps")
    lr_scale: float = option(1.0, "multiplies the learning rate")
    compile: bool = option(False, "torch.compile the step")
    name: str = option("run", "run name")
    out: Optional[str] = option(None, "output folder")
    seed: int | None = option(None, "seed, none for random")
    dims: tuple[int, ...] = option((1, 2), "some sizes")
    tags: list[str] = option(["a"], "free-form tags")
    extra: dict = option({}, "free-form settings")
    weights: dict[str, float] = option({}, "per-source weights")
    dtype: Literal["fp32", "bf16", "fp16"] = option("fp32", "precision")
    device: str = option("auto", "where to run", choices=("auto", "cpu", "cuda", "mps"))
    optim: Optim = option(Optim, "optimizer")
    model: LlamaConfig = option(LlamaConfig, "model shape")


PRESETS = {"tiny": {"steps": 10, "model": {"n_layers": 1}, "name": "tiny"},
           "small": {"model.n_layers": 8, "optim.lr": 1e-3}}


def over(**kv):
    """resolve() with dotted keys written as '__' in Python keyword arguments."""
    return resolve(Cfg, overrides={k.replace("__", "."): v for k, v in kv.items()}, context="recipe test")


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------------------------------------
# values of every type

@pytest.mark.parametrize("text, want", [("5", 5), (" 7 ", 7), ("-3", -3), ("1_000", 1000)])
def test_int(text, want):
    assert over(steps=text).steps == want


@pytest.mark.parametrize("text, want", [("1e-3", 1e-3), ("2", 2.0), ("0.5", 0.5), ("-1E2", -100.0)])
def test_float(text, want):
    value = over(lr_scale=text).lr_scale
    assert value == want and type(value) is float


@pytest.mark.parametrize("text, want", [("true", True), ("True", True), ("YES", True), ("1", True), ("on", True),
                                        ("false", False), ("False", False), ("no", False), ("0", False)])
def test_bool(text, want):
    assert over(compile=text).compile is want


@pytest.mark.parametrize("text, want", [("none", None), ("None", None), ("null", None), ("runs/a", "runs/a")])
def test_optional_str(text, want):
    assert over(out=text).out == want


@pytest.mark.parametrize("text, want", [("none", None), ("42", 42)])
def test_optional_int_union_syntax(text, want):
    assert over(seed=text).seed == want


@pytest.mark.parametrize("text, want", [("1,2,3", (1, 2, 3)), ("4", (4,)), ("4,", (4,)), ("(5, 6)", (5, 6)),
                                        ("[7,8]", (7, 8)), ("", ()), ("()", ())])
def test_variadic_tuple(text, want):
    assert over(dims=text).dims == want


def test_fixed_tuple_and_list():
    assert over(optim__betas="0.8, 0.99").optim.betas == (0.8, 0.99)
    assert over(tags="x,y").tags == ["x", "y"]
    assert "has 3 items, expected 2" in error(over, optim__betas="1,2,3")
    assert error(over, dims="1,x") == "bad value for 'dims': 'x' is not an int"


def test_dict_from_json_toml_and_dotted_entries():
    assert over(extra='{"a": 1, "b": [1, 2]}').extra == {"a": 1, "b": [1, 2]}
    assert over(extra='{a = 1, b = "x"}').extra == {"a": 1, "b": "x"}
    assert over(weights='{"web": 1, "code": 0.5}').weights == {"web": 1.0, "code": 0.5}
    cfg = over(model__rope_scaling__factor="8", model__rope_scaling__rope_type="llama3")
    assert cfg.model.rope_scaling == {"factor": 8, "rope_type": "llama3"}
    assert "is not a dict" in error(over, extra="[1, 2]")
    assert error(over, weights='{"web": "lots"}') == "bad value for 'weights': 'lots' is not a float"


def test_literal_and_choices():
    assert over(dtype="bf16").dtype == "bf16"
    assert over(device="cuda").device == "cuda"
    assert error(over, dtype="int8") == "bad value for 'dtype': 'int8'; choose one of fp32, bf16, fp16"
    assert error(over, device="tpu") == "bad value for 'device': 'tpu'; choose one of auto, cpu, cuda, mps"


def test_typed_values_are_checked_like_strings():
    cfg = resolve(Cfg, overrides={"steps": 5, "lr_scale": 2, "compile": True, "dims": [3, 4],
                                  "optim.betas": [0.5, 0.6], "out": None})
    assert (cfg.steps, cfg.lr_scale, cfg.compile, cfg.dims, cfg.optim.betas, cfg.out) == \
        (5, 2.0, True, (3, 4), (0.5, 0.6), None)
    assert type(cfg.lr_scale) is float
    assert error(over, steps=True) == "bad value for 'steps': True is not an int"
    assert error(over, steps=2.5) == "bad value for 'steps': 2.5 is not an int"
    assert error(over, lr_scale=False) == "bad value for 'lr_scale': False is not a float"
    assert error(over, name=5) == "bad value for 'name': 5 is not a str"
    assert error(over, compile=1) == "bad value for 'compile': 1 is not a bool (true/false)"


@pytest.mark.parametrize("key, text, message", [
    ("steps", "abc", "bad value for 'steps': 'abc' is not an int"),
    ("steps", "1e3", "bad value for 'steps': '1e3' is not an int"),
    ("lr_scale", "fast", "bad value for 'lr_scale': 'fast' is not a float"),
    ("compile", "maybe", "bad value for 'compile': 'maybe' is not a bool (true/false)"),
    ("seed", "x", "bad value for 'seed': 'x' is not an int"),
    ("model.n_layers", "two", "bad value for 'model.n_layers': 'two' is not an int"),
])
def test_wrong_type_names_the_key(key, text, message):
    assert error(resolve, Cfg, overrides={key: text}) == message


# ----------------------------------------------------------------------------------------------------------
# keys

def test_dotted_keys_reach_nested_configs():
    cfg = over(optim__lr="1e-2", model__n_layers="2", steps="3")
    assert (cfg.optim.lr, cfg.model.n_layers, cfg.steps) == (1e-2, 2, 3)
    assert cfg.optim.betas == (0.9, 0.95) and cfg.model.d_model == 128


def test_nested_config_is_built_from_its_class_so_derived_fields_follow():
    # LlamaConfig derives head_dim and n_kv_heads from n_heads in __post_init__
    cfg = over(model__n_heads="8")
    assert (cfg.model.head_dim, cfg.model.n_kv_heads) == (16, 8)


def test_unknown_key_suggests_and_lists_valid_keys():
    message = error(over, optim__lrr="1")
    assert message.startswith("unknown key 'optim.lrr' for recipe test; did you mean 'optim.lr'?")
    assert message.endswith("valid keys: optim.lr, optim.betas")
    message = error(over, lrr="1")
    assert message.startswith("unknown key 'lrr' for recipe test; did you mean 'optim.lr'?")
    assert "valid keys: steps, lr_scale, compile," in message and "optim.*, model.*" in message
    assert "did you mean 'model.n_layers'?" in error(over, n_layers="2")
    assert error(over, zzz="1").startswith("unknown key 'zzz' for recipe test; valid keys: steps,")
    assert "unknown key 'steps.x'" in error(over, steps__x="1")


def test_a_section_is_not_a_value():
    assert "'model' is a section" in error(over, model="big")


def test_post_init_errors_become_config_errors():
    message = error(over, model__d_model="100", model__n_heads="3")
    assert message == "invalid config for recipe test (model): d_model=100 is not divisible by n_heads=3"


def test_missing_required_key():
    @dataclass
    class Needs:
        data: str = option(help="training data")
        steps: int = option(1, "steps")

    assert error(resolve, Needs, overrides={"steps": "2"}) == "missing required key 'data' for Needs"
    assert resolve(Needs, overrides={"data": "x.bin"}).data == "x.bin"


def test_apply_overrides_is_out_of_place():
    base = Cfg()
    new = apply_overrides(base, {"steps": "7", "optim.lr": "0.1", "model.rope_scaling.factor": "2"})
    assert (new.steps, new.optim.lr, new.model.rope_scaling) == (7, 0.1, {"factor": 2})
    assert (base.steps, base.optim.lr, base.model.rope_scaling) == (100, 3e-4, {})
    assert new.model is not base.model and new.dims is base.dims
    assert "unknown key 'stepz' for Cfg; did you mean 'steps'?" in error(apply_overrides, base, {"stepz": 1})


def test_errors_are_user_errors_and_value_errors():
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)


def test_option_defaults():
    a, b = Cfg(), Cfg()
    a.tags.append("mutated")
    assert b.tags == ["a"] and a.model is not b.model
    fields = {f.name: f for f in dataclasses.fields(Cfg)}
    assert fields["device"].metadata["help"] == "where to run"
    with pytest.raises(ValueError):
        option("tpu", "device", choices=("cpu", "cuda"))


# ----------------------------------------------------------------------------------------------------------
# layers: defaults < preset < config file < command line

def write(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_load_toml_flattens_tables(tmp_path):
    path = write(tmp_path, 'steps = 5\n[optim]\nlr = 0.01\n[model]\nn_layers = 3\n'
                           '[model.rope_scaling]\nfactor = 8.0\n')
    assert load_toml(path) == {"steps": 5, "optim.lr": 0.01, "model.n_layers": 3,
                               "model.rope_scaling.factor": 8.0}


def test_load_toml_errors_name_the_file(tmp_path):
    assert error(load_toml, tmp_path / "nope.toml") == f"config file {tmp_path / 'nope.toml'} not found"
    path = write(tmp_path, "steps = 5\nlr = = 3\n")
    message = error(load_toml, path)
    assert message.startswith(f"bad config file {path}:") and "line 2" in message


def test_precedence(tmp_path):
    toml = load_toml(write(tmp_path, 'steps = 20\nname = "file"\n[model]\nn_layers = 3\n'))
    cfg = resolve(Cfg, presets=PRESETS, preset="tiny", toml=toml, overrides={"steps": "30"})
    assert cfg.steps == 30                  # command line beats the file
    assert cfg.name == "file"               # the file beats the preset
    assert cfg.model.n_layers == 3          # ... also in nested sections
    assert cfg.lr_scale == 1.0              # defaults fill the rest
    cfg = resolve(Cfg, presets=PRESETS, preset="tiny", toml={}, overrides={})
    assert (cfg.steps, cfg.name, cfg.model.n_layers) == (10, "tiny", 1)
    cfg = resolve(Cfg, presets=PRESETS, preset="small", overrides={"optim.lr": "0.5"})
    assert (cfg.model.n_layers, cfg.optim.lr) == (8, 0.5)


def test_file_can_name_its_preset(tmp_path):
    toml = load_toml(write(tmp_path, 'preset = "tiny"\nname = "mine"\n'))
    cfg = resolve(Cfg, presets=PRESETS, toml=toml)
    assert (cfg.steps, cfg.name) == (10, "mine")
    cfg = resolve(Cfg, presets=PRESETS, preset="small", toml=toml)      # explicit preset wins
    assert (cfg.steps, cfg.model.n_layers, cfg.name) == (100, 8, "mine")


def test_file_values_are_type_checked(tmp_path):
    toml = load_toml(write(tmp_path, 'steps = "many"\n'))
    assert error(resolve, Cfg, toml=toml) == "bad value for 'steps': 'many' is not an int"
    toml = load_toml(write(tmp_path, "[optim]\nlrr = 0.1\n"))
    assert error(resolve, Cfg, toml=toml).startswith("unknown key 'optim.lrr' for Cfg; did you mean 'optim.lr'?")


def test_unknown_preset():
    message = error(resolve, Cfg, presets=PRESETS, preset="huge", context="recipe test")
    assert message == "unknown preset 'huge' for recipe test; valid presets: tiny, small"
    assert "has no presets" in error(resolve, Cfg, preset="tiny")


# ----------------------------------------------------------------------------------------------------------
# help and dicts

def test_describe_lists_every_key():
    rows = {key: rest for key, *rest in describe(Cfg)}
    assert rows["steps"] == ["int", "100", "optimizer steps"]
    assert rows["out"] == ["str | None", "none", "output folder"]
    assert rows["dims"] == ["tuple[int, ...]", "1,2", "some sizes"]
    assert rows["device"] == ["auto|cpu|cuda|mps", "auto", "where to run"]
    assert rows["dtype"] == ["fp32|bf16|fp16", "fp32", "precision"]
    assert rows["optim.betas"] == ["tuple[float, float]", "0.9,0.95", "Adam betas"]
    assert rows["model.n_layers"] == ["int >= 1", "4", "transformer blocks"]
    assert len(rows) == 12 + 2 + len(dataclasses.fields(LlamaConfig))
    assert {key: value for key, _, value, _ in describe(over(steps="9"))}["steps"] == "9"


def test_format_help_has_a_row_per_key_and_the_presets():
    text = format_help(Cfg, PRESETS)
    assert all(key in text for key, *_ in describe(Cfg))
    line = next(l for l in text.splitlines() if l.split()[:1] == ["optim.lr"])
    assert line.split()[:3] == ["optim.lr", "float", "0.0003"] and line.endswith("peak learning rate")
    assert "tiny" in text and "model.n_layers=1" in text and "optim.lr=0.001" in text


def test_to_dict_from_dict_round_trip():
    cfg = over(steps="3", dims="4,5", model__n_heads="8", out="x")
    d = to_dict(cfg)
    assert d["model"]["n_layers"] == 4 and d["optim"]["betas"] == (0.9, 0.95)
    assert from_dict(Cfg, d) == cfg
    d["dims"], d["optim"]["betas"] = [4, 5], [0.9, 0.95]      # msgpack gives lists back
    assert from_dict(Cfg, d) == cfg
    assert from_dict(Cfg, {"steps": 4}).steps == 4            # missing keys take defaults


def test_from_dict_is_strict():
    assert "unknown key 'optim.lrr'" in error(from_dict, Cfg, {"optim": {"lrr": 1.0}})
    assert error(from_dict, Cfg, {"steps": 2.5}) == "bad value for 'steps': 2.5 is not an int"
    assert error(from_dict, Cfg, {"model": 4}).startswith("'model' is a section")
