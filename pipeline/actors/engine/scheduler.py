"""Which sequences run next: admit waiting ones while slots and pages last, else decode the running ones."""

from __future__ import annotations

import math
import time
from collections import deque

from pipeline.actors.engine.block_manager import BlockManager
from pipeline.actors.engine.request import Sequence

# A decode step takes its rows longest first. The attention kernels start their programs row by row
# (kivi_kernels/decode_attention/common.ROW_MAJOR), so the longest programs start first and the short ones fill the
# last wave (longest-processing-time first); in arrival order the last wave mixes long and short rows, and the
# step waits for the long ones. False: arrival order (benchmarks' A/B).
LONGEST_FIRST = True
# A growing sequence (Sequence.grows: EngineConfig.page_growth, and it may stop early) is admitted with the pages of
# its prefill and this many more tokens, and before each run of decode steps a growing sequence within this many
# tokens of its pages' end gets another page: a run of steps launched ahead (LLMEngine._decode) then lasts at least
# this many steps.
GROWTH_LOOKAHEAD = 16
# ... and it is only admitted while this share of all pages stays free for the running ones to grow into (vLLM's
# watermark), so that a new prompt does not take the page an older sequence needs at its next step,
SPARE_PAGE_SHARE = 0.01
# ... and while the pages that the growing sequences in flight are projected to take still fit: each is projected to
# end at its prompt and used_share of its max_new_tokens, the mean share that the last SHARE_WINDOW growing
# sequences to finish generated (INITIAL_SHARE until one has: at first as if each reserved its whole length, so rows
# that all run to max_new_tokens are never preempted; rows that stop early make room for more).
SHARE_WINDOW = 256
INITIAL_SHARE = 1.0


class Scheduler:
    def __init__(self, blocks: BlockManager, prefill_tokens: int) -> None:
        self.blocks = blocks
        self.spare_pages = int(SPARE_PAGE_SHARE * blocks.num_pages)  # kept free by a growing sequence's admission
        self.shares: deque[float] = deque(maxlen=SHARE_WINDOW)  # of max_new_tokens, by growing sequences finished
        self.max_prefill_tokens = prefill_tokens
        # padded tokens per prefill forward: halved on an OOM, then regrows up to max_prefill_tokens, which a
        # prefill OOM lowers to half the size that failed
        self.prefill_tokens = prefill_tokens
        self.max_running = blocks.num_slots  # sequences in flight (halved on a decode OOM)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def carry_over(self, old: Scheduler) -> None:
        """Keep what an earlier build's scheduler learned (a rebuild's): finished rows' shares of new tokens and the
        limits its out-of-memory errors set."""
        self.shares.extend(old.shares)
        self.max_prefill_tokens = min(self.max_prefill_tokens, old.max_prefill_tokens)
        self.prefill_tokens = min(self.prefill_tokens, old.prefill_tokens)
        self.max_running = min(self.max_running, old.max_running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stalled(self) -> str:
        """Why waiting sequences cannot start although none runs (a slot or page lost: the step would spin)."""
        return (f"{len(self.waiting)} waiting requests fit no free slot and pages ({len(self.blocks.free_slots)} of "
                f"{self.blocks.num_slots} slots, {len(self.blocks.free_pages)} of {self.blocks.num_pages} pages free) "
                "with none running: the engine's cache bookkeeping is broken")

    def next_prefill(self) -> list[Sequence]:
        """Admit waiting sequences in order while they fit; their padded batch stays under the budget, and no
        prompt in it is under half the batch's longest."""
        batch: list[Sequence] = []
        while self.waiting and self._fits(self.waiting[0], batch) and (
            len(self.running) + len(batch) < self.max_running
        ):
            seq = self.waiting[0]
            lengths = [s.cached_len for s in batch] + [seq.cached_len]  # prefill lengths (prompt + any output)
            if batch and max(lengths) * len(lengths) > self.prefill_tokens:
                break
            if batch and 2 * min(lengths) < max(lengths):  # a row padded past twice its length: the engine queues
                break  # prompts longest first, so the next batch takes this one soon
            self.blocks.admit(self.waiting.popleft(), self._admitted_len(seq))
            batch.append(seq)
        return batch

    def _admitted_len(self, seq: Sequence) -> int | None:
        """Tokens whose pages a sequence takes when admitted: its whole length (None), or if it grows its prefill's
        (prompt and any output before a preemption) and GROWTH_LOOKAHEAD more."""
        return _lookahead_len(seq) if seq.grows else None

    @property
    def used_share(self) -> float:
        """Mean share of max_new_tokens that the last growing sequences to finish generated."""
        return sum(self.shares) / len(self.shares) if self.shares else INITIAL_SHARE

    def _projected_pages(self, seq: Sequence) -> int:
        """Pages a growing sequence is projected to hold at its end: at its prompt and used_share of its new tokens,
        or GROWTH_LOOKAHEAD past where it is, and at least what it holds."""
        end = min(seq.total_len, seq.prompt_len + math.ceil(self.used_share * seq.max_new_tokens))
        return max(len(seq.pages), self.blocks.pages_for(end), self.blocks.pages_for(_lookahead_len(seq)))

    def _fits(self, seq: Sequence, batch: list[Sequence]) -> bool:
        """Whether a waiting sequence can be admitted now: a slot and the pages it takes (its whole length, or if it
        grows its admission's), and room left for the pages that the growing sequences (it among them) are
        projected to take, with spare_pages over where any grows. Alone, a sequence only needs what it takes: the
        engine admits no request whose whole length does not fit the cache (BlockManager.fits_ever)."""
        admitted = self._admitted_len(seq)
        if not (self.running or batch):
            return self.blocks.can_admit(seq, admitted)
        growing = [s for s in (*self.running, *batch) if s.grows]
        to_come = sum(self._projected_pages(s) - len(s.pages) for s in growing)
        need = self._projected_pages(seq) if seq.grows else self.blocks.pages_for(seq.total_len)
        spare = self.spare_pages if (seq.grows or growing) else 0
        return self.blocks.can_admit(seq, admitted) and need + to_come + spare <= len(self.blocks.free_pages)

    def reserve(self) -> tuple[list[Sequence], list[Sequence]]:
        """Before a run of decode steps: each growing sequence in flight (oldest first) that holds fewer than
        GROWTH_LOOKAHEAD tokens past its cached length gets pages for them, or failing that for its next step;
        when too few pages are free even for that, the newest growing sequences in flight that do not yet hold
        their whole length are preempted (it may be the one that grows itself; a sequence that holds its whole
        length never is). Returns (grown, preempted)."""
        grown: list[Sequence] = []
        preempted: list[Sequence] = []
        for seq in list(self.running):  # admission order
            if not seq.grows or seq.slot < 0 or self.blocks.holds(seq, target := _lookahead_len(seq)):
                continue  # holds its whole length, preempted just now, or room enough
            while not (self.blocks.grow(seq, target) or self.blocks.grow(seq, seq.cached_len + 1)):
                # seq itself at the latest: it holds less than its lookahead, so less than its whole length
                victim = next(s for s in reversed(self.running)
                              if s.grows and (s is seq or not self.blocks.holds(s, s.total_len)))
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                grown.append(seq)
        return grown, preempted

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence's slot and pages back and queue it first; it keeps its output, and its next
        prefill runs prompt + output (Sequence.prefill_ids) to rebuild the cache (vLLM's recompute preemption)."""
        self.blocks.release(seq)
        self.running.remove(seq)
        seq.preemptions += 1
        seq.t_preempted = time.perf_counter()
        self.waiting.appendleft(seq)

    def chunk_size(self, batch: list[Sequence]) -> int | None:
        """The chunks a prefill of this batch goes in (ModelRunner.prefill's chunk_tokens): a lone sequence longer
        than max_prefill_tokens goes in chunks of the prefill budget; anything else whole (None). The length past
        which a prompt goes in chunks is then max_prefill_tokens, which only a prefill's out-of-memory error lowers,
        for good: the memory plan counts a chunked prefill's scratch from it (LLMEngine._scratch_of)."""
        if len(batch) == 1 and batch[0].cached_len > self.max_prefill_tokens:
            return self.prefill_tokens
        return None

    def start_running(self, batch: list[Sequence]) -> None:
        """A prefill went through: its sequences run, and a budget cut by an OOM regrows step by step."""
        self.running.extend(batch)
        self.prefill_tokens = min(self.max_prefill_tokens, self.prefill_tokens * 2)

    def decode_rows(self) -> list[Sequence]:
        """The running sequences in a decode step's row order: the longest cached length first (LONGEST_FIRST),
        ties in the order they started. Rows grow one token a step together, so the order holds over a run of
        steps."""
        if not LONGEST_FIRST:
            return list(self.running)
        return sorted(self.running, key=lambda s: -s.cached_len)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.grows and seq.finish_reason in ("stop", "length"):
            self.shares.append(len(seq.output) / seq.max_new_tokens)

    def shrink(self, seqs: list[Sequence], prefill: bool = False) -> None:
        """Requeue `seqs` from scratch at the front; the next prefill gets at most half their tokens.

        prefill: their prefill ran out of memory, so the budget also never regrows past half its size (a
        prefill of that size would fail again: the cache is allocated once, so free memory does not grow), and
        prompts past that go in chunks (chunk_size); a lone prompt that failed in chunks is retried in chunks half
        as long, and the length past which prompts go in chunks stays.
        """
        # what the failed prefill ran (a preempted sequence's prompt + output), or the prompts that run next
        padded = max(s.cached_len if prefill else s.prompt_len for s in seqs) * len(seqs)
        chunked = prefill and self.chunk_size(seqs) is not None  # it failed in a chunk of prefill_tokens
        for seq in reversed(seqs):
            self.blocks.release(seq)
            if seq in self.running:
                self.running.remove(seq)
            seq.output, seq.t_first, seq.finish_reason, seq.text = [], None, None, None
            # its clock and its count of rebuilds start again with its new output
            seq.t_preempted, seq.preempted_s, seq.preemptions = None, 0.0, 0
            self.waiting.appendleft(seq)
        self.prefill_tokens = max(1, min(self.prefill_tokens, padded) // 2)
        if prefill and not chunked:  # a chunked one's chunks halve, and prompts go whole up to where they did
            self.max_prefill_tokens = min(self.max_prefill_tokens, max(1, padded // 2))


def _lookahead_len(seq: Sequence) -> int:
    """Tokens a growing sequence holds pages for: its cached ones and GROWTH_LOOKAHEAD more, up to its whole length."""
    return min(seq.total_len, seq.cached_len + GROWTH_LOOKAHEAD)
