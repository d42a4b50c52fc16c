"""Sampling parameters and the sampler alone: bad values, top-k and top-p, greedy rows beside sampled ones, seeds."""

from __future__ import annotations

import pytest
import torch

from pipeline.actors.engine import SamplingParams


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2),
                                 dict(stop="x"), dict(seed=1.5), dict(ignore_eos="yes"),
                                 dict(temperature=float("inf")), dict(temperature=float("nan"))])
def test_sampling_params_reject_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams.from_dict({"temprature": 1.0})


def test_sampler_respects_top_k_top_p_and_greedy_rows():
    from pipeline.actors.engine.sampler import sample

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 50, generator=gen) * 3
    n = 400
    rows = logits.repeat(n, 1)  # each of the 6 rows, n times, with different seeds
    temperature = torch.tensor([0.0, 1.0, 1.0, 0.7, 1.0, 2.0]).repeat(n)
    top_k = torch.tensor([0, 5, 0, 0, 1, 3]).repeat(n)
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9, 1.0, 1.0]).repeat(n)
    seeds = torch.arange(6 * n)
    out = sample(rows, temperature, top_k, top_p, seeds, torch.zeros(6 * n, dtype=torch.long)).view(n, 6)
    order = logits.argsort(dim=-1, descending=True)
    probs = logits.softmax(-1).gather(1, order)
    nucleus = lambda r, p: set(order[r, : int((probs[r].cumsum(0) - probs[r] < p).sum())].tolist())
    assert set(out[:, 0].tolist()) == {int(logits[0].argmax())}  # greedy row
    assert set(out[:, 1].tolist()) <= set(order[1, :5].tolist()) and len(set(out[:, 1].tolist())) > 1
    assert set(out[:, 2].tolist()) <= nucleus(2, 0.5)
    assert set(out[:, 3].tolist()) <= nucleus(3, 0.9)
    assert set(out[:, 4].tolist()) == {int(logits[4].argmax())}  # top_k=1 is greedy
    assert set(out[:, 5].tolist()) <= set(order[5, :3].tolist())
    # the draws follow the softmax: the top token of row 1 (top-5 renormalised) within 5 standard errors
    p_top = probs[1, 0] / probs[1, :5].sum()
    freq = (out[:, 1] == order[1, 0]).float().mean()
    assert abs(freq - p_top) < 5 * (p_top * (1 - p_top) / n) ** 0.5


def test_top_p_counts_the_mass_of_the_top_k_only():
    """top_k, then top_p over the survivors renormalized (Hugging Face's warpers, vLLM): over probabilities .4, .3,
    .2, .1 with top_k 2 and top_p 0.5, the top two renormalize to .57 and .43, so only the first is kept (the mass
    of the whole vocabulary would keep both). Then random rows against that rule, drawn many times."""
    from pipeline.actors.engine.sampler import sample

    n = 3000
    fixed = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    out = sample(fixed.repeat(n, 1), torch.ones(n), torch.full((n,), 2), torch.full((n,), 0.5),
                 torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert set(out.tolist()) == {0}
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(4):
        logits = torch.randn(12, generator=gen)
        k, p = int(torch.randint(1, 13, (), generator=gen)), float(torch.rand((), generator=gen)) * 0.9 + 0.05
        order = logits.argsort(descending=True)[:k]
        probs = logits[order].softmax(-1)
        keep = set(order[: int(((probs.cumsum(0) - probs) < p).sum())].tolist())
        out = sample(logits.repeat(n, 1), torch.ones(n), torch.full((n,), k), torch.full((n,), p),
                     torch.arange(n), torch.zeros(n, dtype=torch.long))
        likely = {int(order[i]) for i in range(len(keep)) if probs[i] / probs[: len(keep)].sum() > 0.01}
        assert likely <= set(out.tolist()) <= keep, (k, p)


def test_near_zero_temperatures_are_greedy_and_huge_seeds_and_top_k_sample():
    from pipeline.actors.engine.sampler import picker

    logits = torch.randn(3, 40) * 4
    greedy = logits.argmax(-1)
    cold = [SamplingParams(temperature=t) for t in (1e-30, 1e-6, 0.0)]
    assert torch.equal(picker(cold, [1, 2, 3], [0, 0, 0], torch.device("cpu"))(logits, 0), greedy)
    big = [SamplingParams(temperature=1.0, seed=2**70 + 5, top_k=2**70), SamplingParams(temperature=1.0, seed=5),
           SamplingParams(temperature=1.0, seed=-(2**65))]
    tokens = picker(big, [p.seed for p in big], [0, 0, 0], torch.device("cpu"))(logits[[0, 0, 0]], 0)
    assert tokens[0] == tokens[1]  # the low 32 bits of the seed pick the draws (documented)


def test_a_temperature_just_under_the_greedy_line_is_greedy_in_any_batch():
    """picker decides "all greedy" in double; the rows' tensor must agree in float32, where 9.9999999e-6 rounds to
    1e-5: with a sampled row beside them, such rows stay greedy (on logits tied between two tokens, sampling would
    pick the other one about half the time)."""
    from pipeline.actors.engine.sampler import picker

    n = 20
    logits = torch.full((n + 1, 10), -5.0)
    logits[:, 3] = logits[:, 7] = 2.0  # argmax: 3
    params = [SamplingParams(temperature=9.9999999e-6, seed=i) for i in range(n)] + [SamplingParams(temperature=1.0)]
    tokens = picker(params, list(range(n + 1)), [0] * (n + 1), torch.device("cpu"))(logits, 0)
    assert tokens[:n].tolist() == [3] * n
