"""Decode-graph buckets of the model runner: the wider graphs a bucket may run in, and the routing by time."""

from __future__ import annotations

import random

import pytest
import torch

from pipeline.actors.engine.model_runner import batch_buckets, padded_widths, route_buckets


@pytest.mark.parametrize("max_batch, widths", [(238, [240, 256]), (141, [144, 160, 176, 192]), (256, []),
                                               (1, [16, 32, 48, 64]), (64, []), (65, [80, 96, 112, 128])])
def test_padded_widths_reach_the_next_multiple_of_64(max_batch, widths):
    assert padded_widths(max_batch) == widths


def test_route_takes_a_wider_graph_only_when_clearly_faster():
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    for _ in range(200):
        max_batch = rng.randrange(1, 300)
        buckets = batch_buckets(max_batch)
        widths = buckets + padded_widths(max_batch)
        times = {w: rng.uniform(1.0, 2.0) for w in widths}
        route = route_buckets(buckets, times, margin=0.03)
        assert sorted(route) == buckets, seed
        for bucket, width in route.items():
            candidates = [w for w in widths if w >= bucket]
            fastest = min(times[w] for w in candidates)
            assert width in candidates, seed
            if width == bucket:  # its own width: nothing wider beats it by more than the margin
                assert fastest >= 0.97 * times[bucket], seed
            else:  # a wider one: the fastest, and clearly faster than its own
                assert times[width] == fastest and times[width] < 0.97 * times[bucket], seed


def test_route_keeps_every_bucket_when_wider_graphs_are_slower():
    buckets = batch_buckets(100)
    times = {w: float(w) for w in buckets + padded_widths(100)}  # time grows with the width
    assert route_buckets(buckets, times) == {b: b for b in buckets}


def test_route_needs_a_graph_as_wide_as_each_bucket():
    with pytest.raises(ValueError, match="bucket 100"):
        route_buckets([16, 100], {16: 1.0, 32: 1.0})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA graphs")
def test_steps_in_wider_graphs_keep_the_tokens(monkeypatch):
    """Every bucket forced into the widest graph (padding rows of length 0 beside the batch, up to 64 of them):
    the same greedy tokens as each bucket at its own width (fp32 model, full-precision cache, as in the
    fused-projections test: only rounding differences between matmul kernels could differ)."""
    from pipeline.actors.engine import model_runner
    from tests.engine_cases import gpu_fp32_tokens, requests

    reqs = requests([150, 300, 40, 220, 90], [40, 25, 60, 30, 50], seed=random.randrange(2**31))
    widest = lambda buckets, times: {b: max(times) for b in buckets}
    outs, routes = [], []
    for tune in (False, True):
        if tune:
            monkeypatch.setattr(model_runner, "route_buckets", widest)
        tokens, engine = gpu_fp32_tokens(reqs, max_batch_size=3, tune_buckets=tune)
        outs.append(tokens)
        routes.append(dict(engine.runner.route))
    assert routes[0] == {1: 1, 2: 2, 3: 3} and routes[1] == {1: 64, 2: 64, 3: 64}
    assert outs[0] == outs[1]


@pytest.mark.parametrize("short_tokens", [40, 64])
def test_decode_over_the_short_table_keeps_the_tokens(tiny, monkeypatch, short_tokens):
    """Steps whose rows all fit in SHORT_TABLE_TOKENS see a view of the block table's first pages (the launchers
    size their work by its width), the others the whole table: the same greedy tokens as with no short table
    (2-bit KIVI, reference kernels: the view changes no result), both kinds of step taken, and a short step's
    longest row inside the view."""
    from pipeline.actors.engine import EngineConfig, LLMEngine, kv_cache, model_runner
    from tests.engine_cases import SMALL_KIVI, StubTokenizer, requests

    reqs = requests([5, 40, 17, 33, 61, 9, 26], [30, 12, 45, 20, 8, 50, 3], seed=random.randrange(2**31))
    config = EngineConfig(kivi=SMALL_KIVI, max_batch_size=3, page_size=SMALL_KIVI.page_size)
    monkeypatch.setattr(model_runner, "SHORT_TABLE_TOKENS", None)
    expected = [c.token_ids for c in LLMEngine(tiny, StubTokenizer(), config).generate(reqs)]
    monkeypatch.setattr(model_runner, "SHORT_TABLE_TOKENS", short_tokens)
    steps = []
    set_decode = kv_cache.EngineCache.set_decode

    def recording(self, slots, seq_lens, table_pages=None):
        steps.append((table_pages, int(seq_lens.max()) if seq_lens.numel() else 0))
        set_decode(self, slots, seq_lens, table_pages)

    monkeypatch.setattr(kv_cache.EngineCache, "set_decode", recording)
    engine = LLMEngine(tiny, StubTokenizer(), config)
    assert [c.token_ids for c in engine.generate(reqs)] == expected
    pages = short_tokens // SMALL_KIVI.page_size
    assert engine.runner.short_pages == pages and engine.runner.short_tokens == pages * SMALL_KIVI.page_size
    short = [longest for table, longest in steps if table == pages]
    assert short and any(table is None for table, _ in steps)
    assert max(short) <= pages * SMALL_KIVI.page_size
    assert all(longest > pages * SMALL_KIVI.page_size for table, longest in steps if table is None and longest)


def test_short_table_only_for_2bit_kivi_caches_wider_than_it(monkeypatch):
    from types import SimpleNamespace

    from pipeline.actors.engine import model_runner

    def cache(bits, width, page=32, kivi=True):
        storage = SimpleNamespace(kivi=SimpleNamespace(k_bits=bits, page_size=page)) if kivi else SimpleNamespace()
        return SimpleNamespace(storage=storage, block_table=torch.zeros(4, width))

    monkeypatch.setattr(model_runner, "SHORT_TABLE_TOKENS", 1000)
    assert model_runner.short_table_pages(cache(2, 64)) == 31
    assert model_runner.short_table_pages(cache(2, 64, page=128)) == 7
    assert model_runner.short_table_pages(cache(2, 31)) == 0  # no wider than the view
    assert model_runner.short_table_pages(cache(4, 64)) == 0
    assert model_runner.short_table_pages(cache(2, 64, kivi=False)) == 0  # the full-precision cache
    assert model_runner.short_table_pages(cache(2, 64, page=2048)) == 0  # not one page
    monkeypatch.setattr(model_runner, "SHORT_TABLE_TOKENS", None)
    assert model_runner.short_table_pages(cache(2, 64)) == 0


def test_replays_take_the_short_graphs_while_the_longest_row_fits(tiny, monkeypatch):
    """The graph a step replays: the short table's while the longest row (positions + 1 at decode, one more at each
    decode_next) fits in it, the full table's past it, at the width the bucket is routed to (graphs stood in for by
    recorders)."""
    from pipeline.actors.engine import EngineConfig, LLMEngine, model_runner
    from tests.engine_cases import SMALL_KIVI, StubTokenizer, requests

    monkeypatch.setattr(model_runner, "SHORT_TABLE_TOKENS", 64)
    engine = LLMEngine(tiny, StubTokenizer(), EngineConfig(kivi=SMALL_KIVI, max_batch_size=3,
                                                           page_size=SMALL_KIVI.page_size))
    engine.generate(requests([5], [2]))  # builds the runner
    runner, replays = engine.runner, []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def replay(self):
            replays.append(self.name)

    wide = max(runner.buckets)
    runner.route = {b: wide for b in runner.buckets}  # every bucket routed to the widest graph
    runner.graphs = {w: (Recorder(("full", w)), torch.zeros(w, 5)) for w in runner.buckets}
    runner.short_graphs = {w: (Recorder(("short", w)), torch.zeros(w, 5)) for w in runner.buckets}
    limit = runner.short_tokens
    assert limit == 64
    runner.decode([1, 2], [limit - 2, 7], [0, 1])  # longest row limit - 1
    runner.decode_next(torch.tensor([3, 4]))  # limit
    runner.decode_next(torch.tensor([3, 4]))  # limit + 1: past the view
    runner.decode([1, 2, 3], [3, limit - 1, 0], [0, 1, 2])  # other rows: limit again
    runner.decode([1], [limit], [0])  # limit + 1
    assert replays == [("short", wide), ("short", wide), ("full", wide), ("short", wide), ("full", wide)]
