"""A stand-in recipe for the CLI tests: records the config it was given and can raise on request."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from purestep.core.io.checkpoint import CheckpointError
from purestep.core.config import UserError, option, to_dict
from purestep.core.exits import GateFailed, RunStopped

DESCRIPTION = "fake recipe that records its config (tests only)"


class DataError(UserError):
    pass


@dataclass
class Model:
    n_layers: int = option(4, "number of blocks")
    d_model: int = option(128, "width")


@dataclass
class Config:
    steps: int = option(100, "optimizer steps")
    lr: float = option(3e-4, "peak learning rate")
    device: str = option("auto", "where to run", choices=("auto", "cpu", "cuda", "mps"))
    compile: bool = option(False, "torch.compile the step")
    out: Optional[str] = option(None, "write the config here as JSON")
    fail: str = option("none", "raise this kind of error",
                       choices=("none", "user", "data", "checkpoint", "missing", "bug", "interrupt", "gate", "stopped"))
    model: Model = option(Model, "model shape")


PRESETS = {"tiny": {"steps": 10, "model": {"n_layers": 2}}, "small": {"model.n_layers": 8}}

RUNS: list = []


def run(cfg: Config):
    RUNS.append(cfg)
    if cfg.out:
        with open(cfg.out, "w") as fh:
            json.dump(to_dict(cfg), fh)
    errors = {"user": UserError("the dataset is\nempty"), "data": DataError("shard 3 is truncated"),
              "checkpoint": CheckpointError("ckpt.msgpack is corrupt"),
              "missing": FileNotFoundError(2, "No such file or directory", "nowhere.bin"),
              "bug": RuntimeError("an actual bug"), "interrupt": KeyboardInterrupt(),
              "gate": GateFailed("perplexity ratio 1.4 > 1.2"), "stopped": RunStopped("3 rollbacks within 1000 steps")}
    if cfg.fail in errors:
        raise errors[cfg.fail]
    return cfg
