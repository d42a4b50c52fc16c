"""Batched token sampling: greedy, temperature, top-k and top-p, reproducible per request seed.

Random draws come from a counter-based hash of (seed, step, token id), so a request's draws do
not depend on which other requests share its batch (its logits still can, in their last bits, and over a
KIVI cache after a preemption rebuilt its cache from prompt + output: README, "Seeds").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pipeline.actors.engine.request import GREEDY_BELOW

_MASK32 = 0xFFFFFFFF
_MAX_K = 2**31 - 1  # a top_k past the vocabulary cuts nothing


def _hash_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, vocab] from int64 seeds [B] and steps [B] (xorshift-multiply hash)."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = (seeds[:, None] * 0x9E3779B1 + steps[:, None] * 0x7FEB352D + ids[None, :] * 0x2C1B3C6D) & _MASK32
    for mult in (0x45D9F3B, 0x119DE1F3):
        x = ((x ^ (x >> 16)) * mult) & _MASK32
    x = x ^ (x >> 16)
    return (x.double() + 0.5) / 2**32


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32; per-row temperature/top_p float [B], top_k/seeds/steps int64 [B] -> tokens [B].

    Rows with temperature under GREEDY_BELOW are greedy; top_k 0 means no top-k cut, and top_p's mass is counted
    over the top-k survivors (renormalized), as Hugging Face's and vLLM's samplers count it. Every row is computed
    (greedy rows are picked at the end), so nothing waits for the device: the engine can queue its next step
    behind this one.
    """
    greedy = logits.argmax(dim=-1)
    sampled_rows = temperature >= GREEDY_BELOW
    scaled = logits / torch.where(sampled_rows, temperature, 1.0)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    in_top_k = rank < k
    probs = torch.where(in_top_k, sorted_logits, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass (of the top k) ranked above each token
    keep = in_top_k & ((before < top_p[:, None]) | (rank == 0))
    gumbel = -torch.log(-torch.log(_hash_uniform(seeds, steps, vocab)))
    scores = torch.where(keep, sorted_logits.double() + gumbel, float("-inf"))
    picked = order.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(sampled_rows, picked, greedy)


def sampling_rows(params: Sequence, seeds: list[int], steps: list[int], device: torch.device
                  ) -> tuple[torch.Tensor, ...]:
    """sample()'s per-row arguments on `device`: temperature, top_k, top_p, seeds, steps [B], from the rows'
    SamplingParams, seeds and tokens generated so far."""
    # greedy or not is decided here, in double as picker() decides it: a temperature just under GREEDY_BELOW must
    # not round up to it in float32 and sample in a batch with sampled rows while it is greedy alone
    return (torch.tensor([p.temperature if p.temperature >= GREEDY_BELOW else 0.0 for p in params], device=device,
                         dtype=torch.float32),
            torch.tensor([min(p.top_k, _MAX_K) for p in params], device=device, dtype=torch.int64),
            torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32),
            torch.tensor([s & _MASK32 for s in seeds], device=device, dtype=torch.int64),  # the bits the hash uses
            torch.tensor(steps, device=device, dtype=torch.int64))


def picker(params: Sequence, seeds: list[int], steps: list[int], device: torch.device
           ) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """(logits [B, V], k) -> tokens [B] on the device for the k-th decode step from now of these rows: argmax
    when every row is greedy, else sample() with the row tensors made once here and the step counter k on."""
    if all(p.temperature < GREEDY_BELOW for p in params):
        return lambda logits, k: logits.argmax(dim=-1)
    *rows, base = sampling_rows(params, seeds, steps, device)
    return lambda logits, k: sample(logits, *rows, steps=base + k)
