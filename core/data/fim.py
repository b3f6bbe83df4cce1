"""Fill-in-the-middle (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the Middle").

With probability ``fim_rate`` a training window becomes, in the paper's PSM order,
``<fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle``: the window (three tokens shorter, so
the length is unchanged) is cut at two uniform points. This is the paper's *context-level* FIM (applied
to each sampled window rather than to whole documents before packing), which fits a seekable batch
iterator: the choice of rows and cut points is a pure function of ``(seed, cursor, row)``, so resume
and data parallelism stay exact. Next-token loss then teaches the model to generate a middle given both
sides.

Sentinels: a tokenizer that has ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>`` (StarCoder-style
vocabularies) uses them; any other tokenizer (byte, char, a BPE without them) gets three ids appended
after its vocabulary (the model's vocab grows by three and every tokenizer's decode renders them by name,
``core.data.tokenizers.SENTINELS``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from purestep.core.data.tokenizers import SENTINELS


@dataclass(frozen=True)
class FIM:
    rate: float
    prefix: int
    suffix: int
    middle: int

    def apply(self, windows: np.ndarray, seed: int, cursor: int) -> np.ndarray:
        """Rearrange a random ``rate`` fraction of the rows of ``windows`` ``[..., rows, T + 1]``."""
        out = np.array(windows, copy=True)
        flat = out.reshape(-1, out.shape[-1])
        rng = np.random.default_rng([seed, cursor, 0x46494D])   # "FIM": a stream apart from the offsets
        chosen = rng.random(len(flat)) < self.rate
        cuts = np.sort(rng.integers(0, flat.shape[1] - 3 + 1, size=(len(flat), 2)), axis=1)
        for r in np.nonzero(chosen)[0]:
            w = flat[r, :flat.shape[1] - 3].copy()
            i, j = cuts[r]
            flat[r] = np.concatenate([[self.prefix], w[:i], [self.suffix], w[j:], [self.middle], w[i:j]])
        return out


def fim_ids(tokenizer) -> tuple[tuple[int, int, int], int]:
    """The sentinel ids for ``tokenizer`` and how many ids the model needs beyond its vocabulary (0 or 3)."""
    lookup = getattr(tokenizer, "token_id", None)
    if lookup is not None:
        ids = [lookup(name) for name in SENTINELS]
        if all(i is not None for i in ids):
            return tuple(ids), 0
    v = tokenizer.vocab_size
    return (v, v + 1, v + 2), 3
