"""Which sequences run next: admit waiting ones while slots and pages last, else decode the running ones."""

from __future__ import annotations

from collections import deque

from pipeline.actors.engine.block_manager import BlockManager
from pipeline.actors.engine.request import Sequence

# A decode step takes its rows longest first. The attention kernels start their programs row by row
# (kernels/decode_attention/common.ROW_MAJOR), so the longest programs start first and the short ones fill the
# last wave (longest-processing-time first); in arrival order the last wave mixes long and short rows, and the
# step waits for the long ones. False: arrival order (benchmarks' A/B).
LONGEST_FIRST = True


class Scheduler:
    def __init__(self, blocks: BlockManager, prefill_tokens: int) -> None:
        self.blocks = blocks
        self.max_prefill_tokens = prefill_tokens
        # padded tokens per prefill forward: halved on an OOM, then regrows up to max_prefill_tokens, which a
        # prefill OOM lowers to half the size that failed
        self.prefill_tokens = prefill_tokens
        self.max_running = blocks.num_slots  # sequences in flight (halved on a decode OOM)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_prefill(self) -> list[Sequence]:
        """Admit waiting sequences in order while they fit; their padded batch stays under the budget, and no
        prompt in it is under half the batch's longest."""
        batch: list[Sequence] = []
        while self.waiting and self.blocks.can_admit(self.waiting[0]) and (
            len(self.running) + len(batch) < self.max_running
        ):
            seq = self.waiting[0]
            lengths = [s.prompt_len for s in batch] + [seq.prompt_len]
            if batch and max(lengths) * len(lengths) > self.prefill_tokens:
                break
            if batch and 2 * min(lengths) < max(lengths):  # a row padded past twice its length: the engine queues
                break  # prompts longest first, so the next batch takes this one soon
            self.blocks.admit(self.waiting.popleft())
            batch.append(seq)
        return batch

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

    def shrink(self, seqs: list[Sequence], prefill: bool = False) -> None:
        """Requeue `seqs` from scratch at the front; the next prefill gets at most half their tokens.

        prefill: their prefill ran out of memory, so the budget also never regrows past half its size (a
        prefill of that size would fail again: the cache is allocated once, so free memory does not grow).
        """
        for seq in reversed(seqs):
            self.blocks.release(seq)
            if seq in self.running:
                self.running.remove(seq)
            seq.output, seq.t_first, seq.finish_reason, seq.text = [], None, None, None
            self.waiting.appendleft(seq)
        padded = max(s.prompt_len for s in seqs) * len(seqs)
        self.prefill_tokens = max(1, min(self.prefill_tokens, padded) // 2)
        if prefill:
            self.max_prefill_tokens = min(self.max_prefill_tokens, max(1, padded // 2))
