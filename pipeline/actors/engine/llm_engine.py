"""LLMEngine: continuous batching over the paged KIVI (or bf16) cache.

Each loop iteration either prefills newly admitted requests (longest prompts first, as many as have a free
slot and pages, up to a padded-token budget) or runs decode steps for every sequence in flight. Pages are taken as
sequences grow (EngineConfig.page_growth); when none is free the newest sequences are preempted and later prefilled
again from prompt + output. A finished sequence frees its slot and pages at once, and the next waiting request
takes them. The cache is planned, allocated and captured at the first call (build.CacheBuilds), and once more
for a later prompt whose chunked prefill needs more scratch than that build left room for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from pipeline.actors.engine.build import CacheBuilds
from pipeline.actors.engine.config import EngineConfig
from pipeline.actors.engine.counters import EngineCounters
from pipeline.actors.engine.request import Completion, Request, Sequence, Submission
from pipeline.actors.engine.sampler import picker

log = logging.getLogger(__name__)
# a lone prompt whose chunked prefill runs out of memory is retried in chunks half as long, down to this many tokens
# (its full-precision scratch stays the same size; each chunk's activations shrink with the chunk)
MIN_CHUNK_TOKENS = 256


class LLMEngine(CacheBuilds):
    def __init__(self, model, tokenizer, config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = config or EngineConfig()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2**31
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        self.vocab_size = model.get_input_embeddings().num_embeddings  # prompt ids must index it
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {t for t in [*eos, tokenizer.eos_token_id] if t is not None}
        self.runner = None  # model_runner.ModelRunner, with cache, blocks and scheduler, once built (build.py)
        self.plan = None  # memory.CachePlan of the cache built
        self.scratch_room = 0  # bytes a chunked prefill's scratch may take in this build (memory.scratch_room)
        self.planned_lens: tuple[list[int], list[int]] = ([], [])  # what the build was planned for (_plan_lengths)
        self.scratch_asked = 0  # the scratch the build's plan asked for (set aside, or planned without: no room)
        self.build_s: float | None = None  # plan, allocation and graph capture (the first call's, and any rebuild's)
        self.ready_at = 0.0  # perf_counter when the build ended: time to first token counts from here at the earliest
        self.active: list[Submission] = []  # calls of add() with requests still in flight
        self.interrupt: Callable[[], bool] = lambda: False  # True: end a run of decode steps launched ahead
        self.generated_tokens = self.finished_rows = 0  # since the engine was made (live progress)
        self.counters = EngineCounters(self.device)
        self.stats_acc = self.counters.acc  # totals since the last reset_stats()

    # -- requests --------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run every request to completion; completions come back in the order of `requests`."""
        t_start = time.perf_counter()
        try:
            submission = self.add(requests)
            while submission.pending:
                self.step()
        except BaseException:  # nothing else is in flight in this call's engine: leave it empty for the next call
            self.abort()
            raise
        finally:
            self.stats_acc["wall_s"] += time.perf_counter() - t_start
        return submission.results

    def add(self, requests: list[Request], on_done: Callable[[Submission], None] | None = None,
            t_start: float | None = None) -> Submission:
        """Queue requests behind those already in flight; on_done(submission) runs (in step()) once all of them
        are complete (at once if none is valid). The first call plans the cache for requests like these.
        t_start: when the requests arrived (default now); time to first token counts from there, or from the end of
        the first build (reported in build_s) if that came later."""
        sub = Submission(results=[None] * len(requests), t_start=t_start or time.perf_counter(), on_done=on_done)
        seqs = []
        for index, request in enumerate(requests):
            problem = request.problem(self.max_model_len, self.vocab_size)
            if problem:
                sub.results[index] = request.error(problem)
                continue
            seqs.append(self.sequence(index, request, sub))
        if seqs and self.runner is None:
            self._build(seqs)
        # longest prompts first: prefill batches are padded to their longest prompt, so neighbours of similar
        # length waste little (a mixed RAG batch in arrival order padded 2,465 prompt tokens to 11,124)
        for seq in sorted(seqs, key=lambda s: -s.prompt_len):
            if not self.blocks.fits_ever(seq):
                sub.results[seq.index] = seq.request.error("request does not fit the cache")
            else:
                sub.pending += 1
                self.scheduler.add(seq)
        self.active.append(sub)
        if not sub.pending:
            self._done(sub)
        return sub

    def sequence(self, index: int, request: Request, sub: Submission | None = None) -> Sequence:
        """A valid request's sequence: new tokens within max_model_len, and pages as it grows where it may."""
        room = self.max_model_len - len(request.prompt_token_ids)
        seq = Sequence.start(index, request, min(request.sampling.max_new_tokens, room), sub)
        seq.grows = self.config.page_growth and request.may_stop_early(self.eos_ids)
        return seq

    def abort(self) -> None:
        """Drop every request in flight (after a step failed): their slots and pages come back, unanswered."""
        if self.runner is not None:
            for seq in [*self.scheduler.waiting, *self.scheduler.running]:
                self.blocks.release(seq)
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
        self.active.clear()

    def has_work(self) -> bool:
        return self.runner is not None and self.scheduler.has_work()

    def step(self) -> None:
        """Prefill newly admitted requests, or else run decode steps for the sequences in flight. A waiting prompt
        whose chunked prefill needs more scratch than the build left room for holds the queue until the sequences
        in flight are done; then the engine builds its cache again for it and those behind it."""
        waiting = self.scheduler.waiting
        if waiting and self._scratch_short(waiting[0]):
            if self.scheduler.running:
                self._decode()
                return
            self._rebuild()
        batch = self.scheduler.next_prefill()
        if batch:
            self._prefill(batch)
        elif self.scheduler.running:
            self._decode()
        elif self.scheduler.waiting:  # nothing runs, so every slot and page is free: the head must have fitted
            raise RuntimeError(self.scheduler.stalled())

    # -- steps -----------------------------------------------------------------------------
    def _prefill(self, batch: list[Sequence]) -> None:
        t0 = time.perf_counter()
        try:
            for seq in batch:
                self.cache.set_pages(seq.slot, seq.pages)
            logits = self.runner.prefill([s.prefill_ids for s in batch], [s.slot for s in batch],
                                         chunk_tokens=self.scheduler.chunk_size(batch))
        except torch.OutOfMemoryError:
            self._out_of_memory(batch, prefill=True)
            return
        except BaseException:  # admitted but not running (an error, or an interrupt): requeued, so that abort()
            for seq in reversed(batch):  # gives them back or the next step admits them again
                self.blocks.release(seq)
                self.scheduler.waiting.appendleft(seq)
            raise
        self.scheduler.start_running(batch)
        lengths = [(s.cached_len, len(s.output)) for s in batch]  # prefilled, and of them output (a preempted row)
        self._sample_and_advance(batch, logits)  # reads the first tokens: the prefill's GPU work is done
        self.stats_acc["prefill_s"] += time.perf_counter() - t0
        self.stats_acc["prefill_tokens"] += sum(n for n, _ in lengths)
        self.stats_acc["recomputed_tokens"] += sum(n for n, out in lengths if out)  # prefilled before, then preempted

    def _decode(self) -> None:
        """Decode steps for the running sequences. While no row ends by length, step i+1 is launched from
        step i's tokens on the device before the host reads them, so the host's bookkeeping overlaps the GPU's
        next step. A row that stops early (end of sequence, a stop string) then runs one step too many into
        its own pages; that token is dropped. With page growth a run also ends before a row's pages are full, and
        the next one first gives rows near their pages' end another page (Scheduler.reserve)."""
        grown, preempted = self.scheduler.reserve()
        for seq in grown:
            self.cache.set_pages(seq.slot, seq.pages)
        self.stats_acc["preemptions"] += len(preempted)
        running = self.scheduler.decode_rows()  # longest first: the kernels' last wave gets the short rows
        if not running:
            return
        t0, steps = time.perf_counter(), 0
        # the sampling rows go to the device before the step: a copy queued behind it would wait for it
        pick = _picker(running, self.device) if self.config.decode_ahead else None
        try:
            logits = self.runner.decode([s.output[-1] for s in running], [s.cached_len - 1 for s in running],
                                        [s.slot for s in running])
            if pick is None:
                self._sample_and_advance(running, logits)
                pending, steps = None, 1
            else:
                pending = self.runner.to_host(pick(logits, 0))
            while pending is not None:
                # launch the next step unless a row ended (the step in flight then drains, for the live rows)
                # or one ends by length with this step
                ahead = all(not s.finish_reason and len(s.output) + 1 < s.max_new_tokens for s in running) and (
                    not self.interrupt()) and (  # new requests wait for this run of steps to end
                    all(self.blocks.holds(s, s.cached_len + 1) for s in running if s.grows))
                following = (self.runner.to_host(pick(self.runner.decode_next(pending[0]), steps + 1))
                             if ahead else None)
                now = self.runner.wait(pending)  # before reading the host copy
                self._advance(running, pending[1].tolist(), now)
                steps += 1
                pending = following
        except torch.OutOfMemoryError:
            # layers that ran already stored this step's token: redo every running sequence from scratch
            # (a partial step must never be flushed into a group), with at most half as many in flight
            self.counters.count_steps(steps, len(running), t0)  # the steps that did run
            running = list(self.scheduler.running)
            self.scheduler.max_running = max(1, len(running) // 2)
            self._out_of_memory(running)
            return
        except BaseException:
            self.counters.count_steps(steps, len(running), t0)  # the steps that ran count, whatever cut the run short
            raise
        self.counters.count_steps(steps, len(running), t0)

    def _out_of_memory(self, seqs: list[Sequence], prefill: bool = False) -> None:
        """Shrink the batch and put the work back in the queue. A lone sequence that fails is an error, unless it
        failed in a prefill: a whole one of more than one token goes in chunks next (Scheduler.shrink), a chunked
        one in chunks half as long, down to MIN_CHUNK_TOKENS."""
        torch.cuda.empty_cache()
        self.stats_acc["oom_retries"] += 1
        chunk = self.scheduler.prefill_tokens
        ran = seqs[0].cached_len if prefill else seqs[0].prompt_len  # a resumed prefill ran its output too
        lone = len(seqs) == 1 and chunk <= ran  # no smaller batch to try
        chunked = prefill and self.scheduler.chunk_size(seqs) is not None
        retry = prefill and (chunk > MIN_CHUNK_TOKENS if chunked else ran > 1)  # a whole prefill: chunks are next
        if lone and not retry:
            self.scheduler.finish(seqs[0])
            self.blocks.release(seqs[0])
            alone = f", in chunks of {chunk} tokens" if chunked else ""
            failed = seqs[0].request.error(f"CUDA out of memory for this request alone{alone}")
            failed.preemptions, failed.preempted_s = seqs[0].preemptions, seqs[0].preempted_s
            self._complete(seqs[0], failed)
            return
        self.generated_tokens -= sum(len(s.output) for s in seqs)  # shrink drops their output: it is made again
        self.scheduler.shrink(seqs, prefill=prefill)
        log.warning("CUDA out of memory: requeued %d sequences, prefill budget now %d tokens",
                    len(seqs), self.scheduler.prefill_tokens)

    def _sample_and_advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        self._advance(seqs, _picker(seqs, logits.device)(logits, 0).tolist(), time.perf_counter())

    def _advance(self, seqs: list[Sequence], tokens: list[int], now: float) -> None:
        """Row b of `seqs` got tokens[b]; rows that finished at an earlier step are skipped."""
        self.counters.record_memory(self.cache, self.scheduler.running, self.active)
        for seq, token in zip(seqs, tokens, strict=True):
            if seq.finish_reason:
                continue
            seq.t_first = seq.t_first or now
            if seq.t_preempted is not None:  # the first token of its rebuild (a resumed prefill)
                seq.preempted_s += now - seq.t_preempted
                seq.t_preempted = None
            if token in self.eos_ids and not seq.request.sampling.ignore_eos:
                seq.finish_reason = "stop"
            else:
                seq.output.append(token)
                self.generated_tokens += 1
                if seq.hit_stop_string(self.tokenizer):
                    seq.finish_reason = "stop"
                elif len(seq.output) >= seq.max_new_tokens:
                    seq.finish_reason = "length"
            if seq.finish_reason:
                self._finish(seq, now)

    def _finish(self, seq: Sequence, now: float) -> None:
        self.scheduler.finish(seq)
        self.blocks.release(seq)
        if seq.text is None:  # no stop string cut the text
            seq.text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
        self._complete(seq, Completion(
            request_id=seq.request.request_id, text=seq.text, token_ids=list(seq.output),
            num_input_tokens=seq.prompt_len, finish_reason=seq.finish_reason,
            ttft_s=seq.t_first - max(seq.submission.t_start, self.ready_at),
            decode_s=now - seq.t_first - seq.preempted_s, preemptions=seq.preemptions, preempted_s=seq.preempted_s,
        ))

    def _complete(self, seq: Sequence, completion: Completion) -> None:
        self.finished_rows += 1
        sub = seq.submission
        sub.results[seq.index] = completion
        sub.pending -= 1
        if not sub.pending:
            self._done(sub)

    def _done(self, sub: Submission) -> None:
        self.active.remove(sub)
        if sub.on_done is not None:
            sub.on_done(sub)

    # -- stats -----------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.counters.reset()

    def stats(self) -> dict:
        """Peaks and totals since the last reset_stats(), and the dtypes the model computes in and the cache keeps
        its full-precision tokens and scales in."""
        out = self.counters.snapshot(self.build_s, self.plan if self.runner is not None else None)
        out.update(model_dtype=str(self.dtype).removeprefix("torch."),
                   cache_dtype=str(self.config.torch_cache_dtype(self.dtype)).removeprefix("torch."))
        return out


def _picker(seqs: list[Sequence], device: torch.device):
    """sampler.picker for these sequences: their sampling settings, seeds and tokens generated so far."""
    return picker([s.request.sampling for s in seqs], [s.seed for s in seqs], [len(s.output) for s in seqs], device)
