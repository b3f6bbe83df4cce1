"""core.io: what a run writes and reads back.

Atomic checkpoints in Flax's msgpack wire format with checksums (``checkpoint``, ``checkpoint_format``,
``checkpoint_checksums``), atomic cache folders (``cache``: the one place that renames into place and
fsyncs), metric sinks (``logging``: TensorBoard, ``metrics.jsonl`` and the console progress line;
``board``: TensorBoard's tag names and layout) and run telemetry (``telemetry``: MFU, cost, preemption
signals). Imports the kernel (``core.config``, ``core.exits``, ``core.tree``) and nothing else of core.
"""
