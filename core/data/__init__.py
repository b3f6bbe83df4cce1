"""core.data: text and documents -> tokens -> deterministic, seekable batches (nanoGPT's ``get_batch``, made pure).

``text`` (a text file or folder -> a cached token memmap -> batch ``cursor`` as a pure function of the
cursor), ``documents`` (JSONL documents with loss masks and packing), ``jsonl`` (JSONL records -> token
shards, streamed), ``tokenizers`` (char, byte, BPE), ``chat`` (chat templates), ``sandbox`` (their bounded Jinja
sandbox), ``fim`` (fill-in-the-middle).
Imports the kernel and ``core.io`` (caches, progress), nothing else of core.
"""
