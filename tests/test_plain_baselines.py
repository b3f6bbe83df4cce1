"""Every benchmark's plain baseline is the strongest plain way: ``torch.compile`` over the model and its loss
together, as nanoGPT's ``forward(idx, targets)`` returns the loss (``models.llama_module.LlamaModule``). Each test
stands a recorder in for ``torch.compile`` (the callable runs eagerly, so nothing compiles) and checks that what the
baseline handed it returns a scalar loss; the loss-outside variants, kept as named extra columns, hand it the module
alone and get logits back, so the check can fail."""
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from purestep.core.config import ConfigError
from purestep.models import llama
from purestep.models.llama_module import LlamaModule, load_params

TEXT = "the quick brown fox jumps over the lazy dog. " * 200
TINY = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1)


class CompileRecorder:
    """Stands in for ``torch.compile``: hands back the callable it is given (a module with a forward hook, else a
    wrapper), recording each output of every call as ``(callable, output)``."""

    def __init__(self):
        self.outputs: list = []

    def __call__(self, fn=None, **options):
        if fn is None:   # the decorator form, torch.compile(**options)(fn)
            return lambda f: self(f, **options)
        if isinstance(fn, torch.nn.Module):
            fn.register_forward_hook(lambda module, args, out: self.outputs.append((module, out)))
            return fn

        def called(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.outputs.append((fn, out))
            return out
        return called

    def module_outputs(self) -> list:
        """What the compiled ``LlamaModule`` calls returned."""
        return [out for fn, out in self.outputs if isinstance(fn, LlamaModule)]


@pytest.fixture
def compiled(monkeypatch):
    recorder = CompileRecorder()
    monkeypatch.setattr(torch, "compile", recorder)
    return recorder


def assert_loss_inside(recorder: CompileRecorder) -> None:
    outs = recorder.module_outputs()
    assert outs, "the baseline handed torch.compile no LlamaModule"
    assert all(o.dim() == 0 for o in outs), [tuple(o.shape) for o in outs]


def assert_loss_outside(recorder: CompileRecorder) -> None:
    outs = recorder.module_outputs()
    assert outs and all(o.dim() == 3 for o in outs), [tuple(o.shape) for o in outs]


def test_the_module_returns_nanogpts_loss_given_targets():
    """``LlamaModule(x, y)`` is the mean cross entropy of its logits, ``llama.loss``'s, with -1 ignored as nanoGPT's
    ``ignore_index=-1``; under bf16 autocast it is taken in float32."""
    params = llama.init(TINY, seed=3)
    module = load_params(LlamaModule(TINY), params)
    tok = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = {"x": tok[:, :-1], "y": tok[:, 1:]}
    loss = module(batch["x"], batch["y"])
    assert loss.dim() == 0 and abs(loss.item() - llama.loss(params, batch, TINY).item()) < 1e-6
    ignored = batch["y"].clone()
    ignored[:, :4] = -1
    kept = llama.loss(params, {"x": batch["x"], "y": torch.where(ignored < 0, -100, ignored)}, TINY)
    assert abs(module(batch["x"], ignored).item() - kept.item()) < 1e-6
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module(batch["x"], batch["y"]).dtype == torch.float32


def test_bench_wall_plain_run_compiles_its_loss_with_the_module(tmp_path, monkeypatch, compiled):
    """``recipes/bench/plain_run.py`` (bench.wall's plain process): its steps and its evaluations call the compiled
    module with the targets; ``loss_inside=false`` (the ``plain, loss outside`` side) takes the logits."""
    from purestep.recipes.bench import plain_run
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    (tmp_path / "text.txt").write_text(TEXT)
    cfg = plain_run.PlainRun(data=str(tmp_path / "text.txt"), tokenizer="char", out=str(tmp_path / "inside"),
                             n_layers=1, n_heads=2, d_model=32, batch_size=2, block_size=16, steps=3, eval_every=2,
                             eval_batches=1, log_every=1)
    assert cfg.compile and cfg.loss_inside   # the defaults: compiled, the loss inside
    assert 0 < plain_run.run(cfg)["val_loss"] < 10
    assert_loss_inside(compiled)
    assert len(compiled.module_outputs()) == 3 + 2   # three steps, two evaluations (step 2 and the end)
    outside = CompileRecorder()
    monkeypatch.setattr(torch, "compile", outside)
    plain_run.run(replace(cfg, out=str(tmp_path / "outside"), loss_inside=False))
    assert_loss_outside(outside)


def test_bench_wall_runs_the_loss_inside_plain_loop_at_standards_precision():
    """bench.wall's plain side: the loss inside at ``dtype``'s precision by default (the header says when
    ``plain_dtype`` mixes them); ``loss_outside=true`` adds the weaker loop as a side of its own."""
    from purestep.recipes.bench import wall
    cfg = wall.Config()
    assert list(wall.side_runs(cfg)) == ["standard", "plain"]
    plain = wall.plain_config(cfg, Path("out"))
    assert plain.loss_inside and plain.dtype == cfg.dtype == "bf16"
    assert wall.plain_config(wall.Config(dtype="fp32"), Path("out")).dtype == "fp32"
    assert wall.plain_config(wall.Config(plain_dtype="fp32"), Path("out")).dtype == "fp32"
    assert list(wall.side_runs(wall.Config(loss_outside=True))) == ["standard", "plain", wall.LOSS_OUTSIDE]
    assert not wall.plain_config(cfg, Path("out"), loss_inside=False).loss_inside


def test_bench_speed_plain_compiles_its_loss_with_the_module(tmp_path, monkeypatch, compiled):
    """bench.speed's ``plain`` hands torch.compile the module and calls it with the targets; ``loss_outside=true``
    adds ``plain, loss outside``, whose compiled module returns the logits."""
    from purestep.recipes.bench import speed
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    (tmp_path / "text.txt").write_text(TEXT)
    cfg = speed.Config(data=str(tmp_path / "text.txt"), d_model=32, n_layers=1, n_heads=2, batch_size=2,
                       block_size=16, warmup=1, steps=3, rounds=1, log_every=1, compile=True, threads=0)
    std = speed.Standard(speed.standard_config(replace(cfg, compile=False)), tmp_path / "standard")
    try:
        assert speed.Plain(cfg, std)(3) > 0
        assert_loss_inside(compiled)
        outside = CompileRecorder()
        monkeypatch.setattr(torch, "compile", outside)
        speed.Plain(cfg, std, loss_inside=False)(2)
        assert_loss_outside(outside)
    finally:
        std.logger.close()


def test_bench_speed_names_the_loss_outside_variant(tmp_path, monkeypatch):
    from purestep.recipes.bench import speed
    monkeypatch.setenv("PURESTEP_CACHE", str(tmp_path / "cache"))
    (tmp_path / "text.txt").write_text(TEXT)
    cfg = speed.Config(data=str(tmp_path / "text.txt"), d_model=32, n_layers=1, n_heads=2, batch_size=2,
                       block_size=16, warmup=1, steps=3, rounds=1, log_every=1, compile=False, threads=0,
                       peak_size=64, loss_outside=True)
    rows = speed.run(cfg)["rows"]
    assert list(rows) == ["standard", "plain", "plain, loss outside"] and rows["plain"]["vs_plain"] == 1.0


def test_bench_step_plain_compiles_its_loss_with_the_module(monkeypatch, compiled):
    """bench.step's ``plain compiled`` (and ``plain eager``) call the module with the targets; ``loss_outside=true``
    adds ``plain compiled, loss outside``, which needs compile=true."""
    from purestep.recipes.bench import step
    from purestep.recipes.bench.common import model_and_batch
    cfg = step.Config(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, batch_size=2, block_size=16, warmup=1,
                      steps=1, rounds=1, loss_outside=True)
    assert step._names(cfg) == ["plain eager", "functional eager", "plain compiled", "functional compiled",
                                "plain compiled, loss outside"]
    model_cfg, params, batch = model_and_batch(cfg)
    loss = step._build(cfg, "plain compiled", model_cfg, params, batch)()
    assert loss.dim() == 0
    assert_loss_inside(compiled)
    outside = CompileRecorder()
    monkeypatch.setattr(torch, "compile", outside)
    step._build(cfg, "plain compiled, loss outside", model_cfg, params, batch)()
    assert_loss_outside(outside)
    with pytest.raises(ConfigError, match="loss_outside=true .* needs compile=true"):
        step.Config(compile=False, loss_outside=True)


def test_bench_gpu_plain_compiles_its_loss_with_the_module(monkeypatch, compiled):
    """bench.gpu's ``plain``, the variant its ratio is against, compiles the loss with the module;
    ``plain_loss_outside`` is the loss-outside loop."""
    from purestep.recipes.bench.gpu import speed as gpu_speed
    shape = gpu_speed.SHAPES["tiny"]
    cfg = llama.LlamaConfig(**shape.model)
    device = torch.device("cpu")
    params = llama.init(cfg, seed=0)
    batch = gpu_speed._batch(cfg, shape, device)
    run, how = gpu_speed.VARIANTS["plain"](cfg, params, batch, device, True)
    assert run().dim() == 0 and "the loss inside" in how
    assert_loss_inside(compiled)
    outside = CompileRecorder()
    monkeypatch.setattr(torch, "compile", outside)
    run, how = gpu_speed.VARIANTS["plain_loss_outside"](cfg, params, batch, device, True)
    run()
    assert "the loss outside" in how
    assert_loss_outside(outside)
