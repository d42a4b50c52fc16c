"""Which sequences run next: admit waiting ones while slots and pages last, else decode the running ones."""

from __future__ import annotations

from collections import deque

from pipeline.actors.engine.block_manager import BlockManager
from pipeline.actors.engine.request import Sequence


class Scheduler:
    def __init__(self, blocks: BlockManager, prefill_tokens: int) -> None:
        self.blocks = blocks
        self.prefill_tokens = prefill_tokens  # padded tokens per prefill forward (shrinks on OOM)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_prefill(self) -> list[Sequence]:
        """Admit waiting sequences in order while they fit; their padded batch stays under the budget."""
        batch: list[Sequence] = []
        while self.waiting and self.blocks.can_admit(self.waiting[0]):
            seq = self.waiting[0]
            width = max([s.prompt_len for s in batch] + [seq.prompt_len])
            if batch and width * (len(batch) + 1) > self.prefill_tokens:
                break
            self.blocks.admit(self.waiting.popleft())
            batch.append(seq)
        return batch

    def start_running(self, batch: list[Sequence]) -> None:
        self.running.extend(batch)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)

    def preempt_half(self) -> list[Sequence]:
        """Take the newest half of the running sequences out (their work is redone later)."""
        keep = max(1, len(self.running) // 2)
        out, self.running = self.running[keep:], self.running[:keep]
        return out or self.running[:]

    def shrink(self, seqs: list[Sequence]) -> None:
        """Requeue `seqs` from scratch at the front; the next prefill gets at most half their tokens."""
        for seq in reversed(seqs):
            self.blocks.release(seq)
            if seq in self.running:
                self.running.remove(seq)
            seq.output, seq.t_first, seq.finish_reason, seq.text = [], None, None, ""
            self.waiting.appendleft(seq)
        padded = max(s.prompt_len for s in seqs) * len(seqs)
        self.prefill_tokens = max(1, min(self.prefill_tokens, padded) // 2)
