"""core: model- and recipe-agnostic building blocks. The research kernel sits here at the top; the rest in packages.

The kernel (what a training step is made of, and what research code imports): ``tree`` (pytrees of named
tensors), ``rng`` (counter-based keys in the state), ``state`` (the ``TrainState`` pytree), ``gradients`` (the
gradient engines: ``torch.func``, autograd, sharded per block; data-parallel averaging), ``update``
(``apply_gradients`` and its pieces: loss scale, the non-finite select, health and spike metrics), ``step``
(``make_train_step``: the convenience composition), ``donate``, ``compile``, ``remat``, ``layers`` and
``row_grads`` (wrappers and engines applied from outside the model), ``loss_scale``, ``spike``, ``module`` (the
``nn.Module`` bridge), and the foundations every layer uses: ``config`` (strict dataclass configs) with
``config_bounds``, ``exits`` (exit codes), ``device``, ``host_memory``. Kernel modules import torch, optree and
one another, nothing of the packages below.

Packages, each importing the kernel and the packages listed before it:

- ``core.io``: what a run writes and reads back: atomic checkpoints (Flax's msgpack format), cache folders,
  metric sinks (TensorBoard, JSONL, the progress line), telemetry.
- ``core.data``: text and documents -> tokens -> deterministic, seekable batches; tokenizers, chat, FIM.
- ``core.parallel``: process groups and the functional collectives, FSDP-style sharding of the state.
- ``core.cli``: the command line, config files and help, run folders, grids.

``tests/test_layout.py`` checks these rules.
"""
