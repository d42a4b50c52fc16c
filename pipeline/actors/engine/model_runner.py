"""Runs the model: padded prefill batches, and decode steps replayed from CUDA graphs.

Decode graphs are captured once per batch-size bucket over static input tensors; a step copies
its token ids, positions, slots and lengths into those tensors and replays the bucket's graph.

A bucket's graph may run a wider batch than the bucket (the rows past the batch are padding, with length 0):
the matmuls' kernels differ by shape, and cuBLAS's choice at some widths is slower than at a wider one (on
the H200, Llama-2-7B's decode matmuls take 6.2 ms at 238 rows and 5.3 ms at 256). With tune_buckets the
runner also captures the multiples of 16 up to the next multiple of 64 past max_batch, times every graph
with all rows inactive (the width-dependent part of a step), and routes each bucket to the fastest graph at
least as wide (route_buckets).

Over a 2-bit KIVI cache the runner also captures each width over a narrow view of the block table (short_pages
pages, SHORT_TABLE_TOKENS tokens) and replays those graphs while every row fits in it: the decode-attention
launcher sizes its work by the table's width, and over a table as wide as max_model_len it reads short rows two
blocks an online-softmax step, which is slower on them than one (benchmarks/results/step-20261201-h200.json:
a's rows 196 -> 175 us a layer).
"""

from __future__ import annotations

import inspect
import logging
import time
from contextlib import AbstractContextManager, nullcontext

import torch

from pipeline.actors.engine.kv_cache import EngineCache

log = logging.getLogger(__name__)
# the widest block table, in tokens, whose 2-bit decode calls take one 64-token block an online-softmax step
# (ops_mma.mma_step_blocks: under MMA_PAIRS_MIN_BLOCKS[0] = 16 packed blocks unsplit); None: no short graphs
SHORT_TABLE_TOKENS: int | None = 1000


def short_table_pages(cache: EngineCache) -> int:
    """Pages of the short table view (at most SHORT_TABLE_TOKENS tokens, fewer than the full table), or 0 where
    no short graphs are captured: caches other than 2-bit KIVI (their kernels do not size steps by the table),
    tables no wider, or SHORT_TABLE_TOKENS None."""
    kivi = getattr(cache.storage, "kivi", None)
    if SHORT_TABLE_TOKENS is None or kivi is None or kivi.k_bits != 2:
        return 0
    pages = SHORT_TABLE_TOKENS // kivi.page_size
    return pages if 0 < pages < cache.block_table.shape[1] else 0


def _cache_kwarg(decoder) -> str:
    """transformers 5.24 renamed past_key_values to cache."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def padded_widths(max_batch: int) -> list[int]:
    """Wider graphs a bucket may run in: the multiples of 16 past max_batch, up to the next multiple of 64."""
    top = -(-max_batch // 64) * 64
    return [w for w in range(16, top + 1, 16) if w > max_batch]


def route_buckets(buckets: list[int], widths_ms: dict[int, float], margin: float = 0.03) -> dict[int, int]:
    """bucket -> the graph width it runs at: the fastest measured width >= the bucket, taken only when it is
    more than `margin` (a fraction) faster than the narrowest candidate, so noise keeps the bucket's own width.
    widths_ms: replay time of each captured width (ms)."""
    route = {}
    for bucket in buckets:
        candidates = sorted(w for w in widths_ms if w >= bucket)
        if not candidates:
            raise ValueError(f"no captured graph is as wide as bucket {bucket}: {sorted(widths_ms)}")
        best = min(candidates, key=lambda w: (widths_ms[w], w))
        route[bucket] = best if widths_ms[best] < (1 - margin) * widths_ms[candidates[0]] else candidates[0]
    return route


class ModelRunner:
    def __init__(self, model, cache: EngineCache, max_batch: int, use_cuda_graphs: bool,
                 layers: AbstractContextManager | None = None, tune_buckets: bool = False) -> None:
        self.layers = layers or nullcontext()  # open around every forward (kivi.fused.FusedLayers)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.cache = cache
        self.cache_kwarg = _cache_kwarg(self.decoder)
        self.device = next(model.parameters()).device
        self.buckets = batch_buckets(max_batch)
        self.route = {b: b for b in self.buckets}  # bucket -> the width its steps run at
        self.widths_ms: dict[int, float] = {}  # replay time of each captured width (tune_buckets)
        extra = padded_widths(max_batch) if (use_cuda_graphs and tune_buckets) else []
        rows = max([max_batch, *extra])
        int_buf = lambda: torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.input_ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self.slots, self.seq_lens = int_buf(), int_buf()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.short_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # over the short table
        self.short_pages = short_table_pages(cache)
        self.short_tokens = self.short_pages * getattr(getattr(cache.storage, "kivi", None), "page_size", 0)
        self.last_batch = 0  # rows of the last decode step (decode_next continues it)
        self.longest = 0  # the longest row's seq_len at the last decode step
        if use_cuda_graphs:
            self.capture(self.buckets + extra)
            if tune_buckets:
                self.widths_ms = {w: self._replay_ms(w) for w in self.graphs}
                self.route = route_buckets(self.buckets, self.widths_ms)
                moved = {b: w for b, w in self.route.items() if w != b}
                if moved:
                    log.info("decode buckets run wider (bucket: rows): %s; graph ms by rows: %s", moved,
                             {w: round(ms, 3) for w, ms in sorted(self.widths_ms.items())})

    def _forward(self, **inputs) -> torch.Tensor:
        inputs[self.cache_kwarg] = self.cache
        with self.layers:
            return self.decoder(use_cache=True, **inputs).last_hidden_state

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int], chunk_tokens: int | None = None) -> torch.Tensor:
        """Store the prompts in the cache; returns next-token logits [B, V] (float32).

        A lone prompt longer than chunk_tokens is prefilled in chunks of that many tokens, so the
        activations of one forward stay bounded whatever the prompt length.
        """
        if len(prompts) == 1 and chunk_tokens and len(prompts[0]) > chunk_tokens:
            return self._prefill_chunked(prompts[0], slots[0], chunk_tokens)
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt)
        as_int32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=self.device)
        length_t = as_int32(lengths)
        self.cache.set_prefill(as_int32(slots), torch.zeros_like(length_t), length_t)
        # No padding mask: with right padding, every real query sees only real keys under the causal
        # mask alone, so SDPA can take its flash path (O(T) memory); padded rows are never read.
        hidden = self._forward(input_ids=ids.to(self.device),
                               position_ids=torch.arange(width, device=self.device)[None].expand(len(prompts), -1))
        last = hidden[torch.arange(len(prompts), device=self.device), length_t.long() - 1]  # [B, hidden]
        return self.lm_head(last).float()

    def warm_prefill(self, lengths: list[int], slots: list[int], pages: list[list[int]]) -> None:
        """Prefill dummy prompts of these lengths into free slots (their pages given), so that the prefill
        path's kernels compile now. What they store is never read: a slot's next sequence sets its pages and
        lengths afresh, as after any sequence that finished."""
        if not lengths:
            return
        for slot, slot_pages in zip(slots, pages, strict=True):
            self.cache.set_pages(slot, slot_pages)
        self.prefill([[0] * n for n in lengths], slots)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _prefill_chunked(self, prompt: list[int], slot: int, chunk: int) -> torch.Tensor:
        ids = torch.tensor([prompt], device=self.device)
        slot_t = torch.tensor([slot], dtype=torch.int32, device=self.device)
        try:
            for start in range(0, len(prompt), chunk):
                end = min(start + chunk, len(prompt))
                self.cache.set_chunk(slot_t, start, end, len(prompt))
                hidden = self._forward(input_ids=ids[:, start:end],
                                       position_ids=torch.arange(start, end, device=self.device)[None])
        finally:
            self.cache.end_chunks()
        return self.lm_head(hidden[:, -1]).float()

    def _decode_graph_body(self, batch: int, short: bool = False) -> torch.Tensor:
        self.cache.set_decode(self.slots[:batch], self.seq_lens[:batch], self.short_pages if short else None)
        hidden = self._forward(input_ids=self.input_ids[:batch], position_ids=self.positions[:batch])
        return self.lm_head(hidden[:, -1])

    @torch.inference_mode()
    def capture(self, widths: list[int]) -> None:
        """Capture one decode graph per width (and one over the short table where short_pages), largest first,
        sharing one memory pool."""
        self.seq_lens.zero_()  # every row inactive while capturing: kernels skip them
        pool = None
        for batch in sorted(widths, reverse=True):
            for short in (False, True) if self.short_pages else (False,):
                self._decode_graph_body(batch, short)  # warm up (Triton compiles, allocator settles)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # thread_local: the capture runs in the engine's thread (EngineService) while Ray's threads live on
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits = self._decode_graph_body(batch, short)
                    if short:  # into the full-table graph's logits: one output buffer a width, not two
                        logits = self.graphs[batch][1].copy_(logits)
                pool = graph.pool()
                (self.short_graphs if short else self.graphs)[batch] = (graph, logits)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """One step: token t of row b sits at position positions[b]; returns logits [B, V] (float32)."""
        batch = len(tokens)
        host = torch.tensor([tokens, positions, slots], dtype=torch.long)
        self.input_ids[:batch, 0].copy_(host[0], non_blocking=True)
        self.positions[:batch, 0].copy_(host[1], non_blocking=True)
        self.slots[:batch].copy_(host[2], non_blocking=True)
        self.seq_lens[:batch].copy_(host[1] + 1, non_blocking=True)
        self.longest = max(positions) + 1 if positions else 0
        return self._replay(batch)

    @torch.inference_mode()
    def decode_next(self, tokens: torch.Tensor) -> torch.Tensor:
        """The step after the last decode, for the same rows: row b's token is tokens[b] (on the device,
        long [B]) one position further on. Nothing goes through the host. Returns logits [B, V] (float32)."""
        batch = tokens.shape[0]
        if batch != self.last_batch:
            raise ValueError(f"decode_next for {batch} rows after a step of {self.last_batch}")
        self.input_ids[:batch, 0].copy_(tokens)
        self.positions[:batch] += 1
        self.seq_lens[:batch] += 1
        self.longest += 1
        return self._replay(batch)

    @torch.inference_mode()
    def _replay_ms(self, width: int, reps: int = 5) -> float:
        """Median replay time (ms) of the graph of `width` rows, all of them inactive."""
        self.seq_lens.zero_()
        graph = self.graphs[width][0]
        graph.replay()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[reps // 2]

    def _replay(self, batch: int) -> torch.Tensor:
        bucket = self.route[next(b for b in self.buckets if b >= batch)]
        self.seq_lens[batch:bucket].zero_()
        self.last_batch = batch
        short = 0 < self.longest <= self.short_tokens  # every row fits in the short table
        graphs = self.short_graphs if short else self.graphs
        if bucket in graphs:
            graph, logits = graphs[bucket]
            graph.replay()
            return logits[:batch].float()
        return self._decode_graph_body(bucket, short)[:batch].float()

    @staticmethod
    def to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """Start copying tokens [B] (on the device) to the host: (device tokens, host tokens, event that marks
        the copy done, None on a CPU). Read the host tensor after wait()."""
        if tokens.device.type != "cuda":
            return tokens, tokens, None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tokens.device))  # the stream the copy went on
        return tokens, host, done

    @staticmethod
    def wait(pending: tuple) -> float:
        """Block until to_host's copy is done; returns the time (perf_counter) it was."""
        if pending[2] is not None:
            pending[2].synchronize()
        return time.perf_counter()
