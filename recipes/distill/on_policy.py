"""On-policy distillation: ``recipe=distill on_policy=0.5``: the student continues some of each batch's sequences
itself and the teacher scores what it wrote.

GKD (Agarwal et al. ICLR 2024, "On-Policy Distillation of Language Models"; TRL's ``GKDTrainer``, whose ``lmbda``
is ``on_policy``): training only on teacher-forced text leaves the student untrained on the states its own
samples lead to (exposure bias); distilling on its own continuations, where the teacher's distribution at every
generated position is the target, fixes that. MiniLLM (Gu et al. ICLR 2024) is the reverse KL on-policy
(``kl=reverse``, or ``kl=jsd beta=1``).

Per row of a step's batch (the rows of every micro-batch, each rank its own), a draw with probability ``on_policy``
makes it on-policy (TRL draws once per batch; per row the fraction holds in expectation at any batch size). Of an
on-policy row's window of T = ``block_size`` tokens the first P = ``on_policy_prompt`` stay the data's (the
prompt) and the student generates the other T - P through its KV cache (``models.sampling.generate``: the prompt
prefilled once, one cached position per new token; the decoder ``recipe=generate`` uses), sampling at
``on_policy_temperature`` (0: greedy). In the train step the teacher then runs teacher-forced over the new window,
which gives it the same scores a generation-time forward would. The loss on such a row: the chosen ``kl`` at every
position from the prompt's last token on (the distributions over the student's tokens: T - P + 1 positions, up to
and including the one that predicts a generated EOS; the positions after it are left out, as TRL masks after the
first EOS), and the CE on the prompt's positions only (a CE target on the student's own sample would teach it its
own output). Off-policy rows are unchanged.

Generation runs outside the compiled train step, between the batch and the step (:func:`on_policy_step` wraps
it): a decode is a loop of T - P forwards over a growing cache with sampling from per-row ``torch.Generator`` objects
and a stop at EOS, host decisions a graph cannot hold; and its tokens are data of the loss, not something to
differentiate. As batch values (``x``, ``y``, and ``kd_mask``: the positions the KL counts) they keep the compiled
step one graph of the same shapes with or without on-policy rows, and ``torch.func.grad_and_value`` traces no
decode. The rows chosen and each row's sampling seed are pure functions of (``seed``, data cursor, rank)
(``core.rng``), so a resumed run rolls out exactly what the straight run did, and a row's continuation is what
``recipe=generate`` prints for the same params, prompt, seed (:meth:`OnPolicy.row_seed`) and temperature (up to
the float rounding of a batched forward against a one-row one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from purestep.core import rng
from purestep.core.gradients import autocast
from purestep.models import llama, losses
from purestep.models.sampling import generate

SALT = 0x6F6E706F            # "onpo": the rollouts' keys apart from the run's other streams of the same seed


@dataclass(frozen=True)
class OnPolicy:
    """The rollout of a run: ``rollout(params, batch) -> batch`` with the chosen rows continued by the student."""
    fraction: float            # GKD's lmbda
    prompt: int                # P: the window's tokens kept as the prompt
    temperature: float         # the student's sampling temperature (0: greedy)
    seed: int
    rank: int
    model: llama.LlamaConfig   # the student's
    eos_id: Optional[int]
    precision: str             # the run's dtype (autocast, as recipe=generate)
    layout: object = None      # parallel=fsdp: the params are this rank's shards, gathered for the decode (every step)

    def _key(self, cursor: int) -> torch.Tensor:
        return rng.fold_in(rng.fold_in(rng.key(self.seed ^ SALT), cursor), self.rank)

    def chosen(self, cursor: int, rows: int) -> list[int]:
        """The on-policy rows (indices into the step's rows, micro-batches flattened) at data cursor ``cursor``."""
        draw = rng.uniform(rng.fold_in(self._key(cursor), 0), (rows,))
        return torch.nonzero(draw < self.fraction).flatten().tolist()

    def row_seed(self, cursor: int, row: int) -> int:
        """The sampling seed of row ``row`` at cursor ``cursor`` (``recipe=generate seed=`` draws the same)."""
        return int(rng.fold_in(self._key(cursor), row + 1))

    def __call__(self, params: dict, batch: dict) -> dict:
        x, y = batch["x"], batch["y"]
        cursor, width = int(batch["step"].reshape(-1)[0]), x.shape[-1]
        xs, ys = x.reshape(-1, width).clone(), y.reshape(-1, width).clone()
        kd = ys >= 0
        rows = self.chosen(cursor, xs.shape[0])
        if self.layout is not None:   # a collective: every rank gathers, with rows to roll out or none
            params = self.layout.gather(params)
        if rows:
            new = self.continue_rows(params, xs[rows, :self.prompt], [self.row_seed(cursor, r) for r in rows],
                                     width - self.prompt)
            idx = torch.tensor(rows, device=x.device)
            xs[idx, self.prompt:] = new
            ys[idx, self.prompt - 1:] = losses.IGNORE_INDEX
            kd[idx, self.prompt - 1:] = self.kl_positions(new)
        return {**batch, "x": xs.view(x.shape), "y": ys.view(y.shape), "kd_mask": kd.view(x.shape)}

    def continue_rows(self, params: dict, prompts: torch.Tensor, seeds: list, new_tokens: int) -> torch.Tensor:
        """``[n, new_tokens]``: each prompt row continued by the student (whole ``params``), row ``i`` sampled with
        ``seeds[i]``, as ``recipe=generate`` does for one row (padded with EOS after every row stopped at EOS)."""
        n, total = prompts.shape[0], prompts.shape[1] + new_tokens
        decode = llama.decoder(params, self.model, n, total)
        generators = [torch.Generator(prompts.device).manual_seed(s) for s in seeds]
        with autocast(self.precision, prompts.device.type):
            out = generate(decode, prompts, new_tokens, temperature=self.temperature, generator=generators,
                           eos_id=self.eos_id)
        if out.shape[1] < new_tokens:
            out = torch.cat([out, out.new_full((n, new_tokens - out.shape[1]), self.eos_id)], 1)
        return out

    def kl_positions(self, new: torch.Tensor) -> torch.Tensor:
        """``[n, G + 1]`` bool: the KL positions of rows continued with ``new`` ``[n, G]``: the prompt's last token
        and every generated one, up to the position that predicts the first EOS."""
        n, g = new.shape
        offsets = torch.arange(g + 1, device=new.device).expand(n, -1)
        if self.eos_id is None:
            return torch.ones_like(offsets, dtype=torch.bool)
        eos = new == self.eos_id
        first = torch.where(eos.any(1), eos.int().argmax(1), torch.full((n,), g, device=new.device))
        return offsets <= first[:, None]


def on_policy_step(step: Callable, rollout: Optional[OnPolicy]) -> Callable:
    """``step(state, batch, frozen)`` that first rolls out ``batch``'s on-policy rows with ``state.params`` (eager,
    outside the compiled step; module docstring); ``step`` itself when ``rollout`` is None."""
    if rollout is None:
        return step

    def train(state, batch, frozen=None):
        with torch.no_grad():
            batch = rollout(state.params, batch)
        return step(state, batch, frozen)
    return train
