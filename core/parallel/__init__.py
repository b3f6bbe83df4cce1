"""core.parallel: several processes training one model.

``distributed`` (the process group from torchrun's environment, ``Dist``, and the functional collectives
under whichever names the installed torch has), ``shard``, ``leaf_spec`` and ``shard_blocks`` (the state sharded
along its first axis, FSDP/ZeRO-3 style: gather for the forward, reduce-scatter for the gradients; HSDP's replicas;
sharded checkpoints), ``tensor`` (each block's heads and MLP features split over a mesh's ``tp`` ranks, on DTensors). The
step composes these as pieces (``core.step.Parallel``). Imports the kernel and
``core.io`` (checkpoints), nothing else of core.
"""
