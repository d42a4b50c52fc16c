"""Slots and pages of the engine's cache pool: who holds what, and whether a sequence fits."""

from __future__ import annotations

from pipeline.actors.engine.request import Sequence


class BlockManager:
    """Free lists of cache slots (one per sequence in flight) and pages (its packed tokens).

    A sequence takes a slot and the pages of `tokens` when it is admitted: its whole length (prompt +
    max_new_tokens, the default), so that a running batch never runs out of pages, or less, and then grows
    (grow) as it decodes (EngineConfig.page_growth; the scheduler preempts sequences when no page is free).
    """

    def __init__(self, num_slots: int, num_pages: int, pages_for) -> None:
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.pages_for = pages_for  # tokens -> pages
        self.num_slots, self.num_pages = num_slots, num_pages

    def can_admit(self, seq: Sequence, tokens: int | None = None) -> bool:
        """A free slot, and the pages of `tokens` (default: its whole length)."""
        need = self.pages_for(seq.total_len if tokens is None else tokens)
        return bool(self.free_slots) and len(self.free_pages) >= need

    def fits_ever(self, seq: Sequence) -> bool:
        return self.pages_for(seq.total_len) <= self.num_pages

    def admit(self, seq: Sequence, tokens: int | None = None) -> None:
        seq.slot = self.free_slots.pop()
        seq.pages = [self.free_pages.pop() for _ in range(self.pages_for(seq.total_len if tokens is None else tokens))]

    def holds(self, seq: Sequence, tokens: int) -> bool:
        """Whether the sequence's pages hold `tokens` cached tokens."""
        return self.pages_for(tokens) <= len(seq.pages)

    def grow(self, seq: Sequence, tokens: int) -> bool:
        """Add free pages to an admitted sequence until they hold `tokens`; False (nothing taken) if too few are
        free."""
        need = self.pages_for(tokens) - len(seq.pages)
        if need > len(self.free_pages):
            return False
        seq.pages.extend(self.free_pages.pop() for _ in range(max(0, need)))
        return True

    def release(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            self.free_pages.extend(reversed(seq.pages))
        seq.slot, seq.pages = -1, []

    def warm_up_rows(self, lengths: list[int]) -> tuple[list[int], list[int], list[list[int]]]:
        """(lengths, slots, pages) for dummy prompts of these lengths, in free slots and pages that stay free: as
        many of the prompts as the free slots and pages hold, in order."""
        free_slots, free_pages = self.free_slots[::-1], self.free_pages[::-1]  # the next ones admit() would take
        taken_lengths, slots, pages = [], [], []
        for length in lengths:
            need, used = self.pages_for(length), sum(len(p) for p in pages)
            if len(slots) == len(free_slots) or used + need > len(free_pages):
                break
            taken_lengths.append(length)
            slots.append(free_slots[len(slots)])
            pages.append(free_pages[used:used + need])
        return taken_lengths, slots, pages

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self.free_pages)
