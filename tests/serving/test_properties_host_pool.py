"""Property-based (stateful) test of ``HostPool`` against a plain reference model.

The host pool decides which host slots may be overwritten. A slot handed out twice, a pinned slot
reclaimed, or a hash visible before its copy is committed would serve another session's KV, so
every sequence of allocate / commit / pin / unpin / release / invalidate / drop / reset / touch is
checked after every step: slot accounting adds up to the capacity, pinned and filling slots are
never reclaimed, ``allocate`` takes exactly the slots the documented order names (free list first,
then the least recently used unowned ready slots), and lookups return only committed slots holding
that hash.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokencake.serving.host_pool import HostPool, HostPoolExhausted

CAPACITY = 6
OWNERS = ["st-a", "st-b", "st-c"]
HASHES = [bytes([i]) * 32 for i in range(8)]


class HostPoolMachine(RuleBasedStateMachine):
    """Random pool operations; the model keeps state, hash and owners per slot, plus the order of
    the free list (FIFO) and of the reclaimable LRU (oldest first), so it knows which slots an
    ``allocate`` must hand out."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = HostPool(CAPACITY)
        self.state = ["free"] * CAPACITY
        self.hash: list[bytes | None] = [None] * CAPACITY
        self.owners: list[set[str]] = [set() for _ in range(CAPACITY)]
        #: The hash each slot was committed under and still serves (the only legal lookups).
        self.index: dict[bytes, int] = {}
        self.free_order = list(range(CAPACITY))
        self.lru: list[int] = []
        #: owner -> its slots in the order it pinned them (``release`` frees them in reverse).
        self.pinned: dict[str, list[int]] = {o: [] for o in OWNERS}

    # ---- model helpers
    def _reclaimable(self) -> set[int]:
        return {s for s in range(CAPACITY) if self.state[s] == "ready" and not self.owners[s]}

    def _drop_hash(self, slot: int) -> None:
        h = self.hash[slot]
        if h is not None and self.index.get(h) == slot:
            del self.index[h]
        self.hash[slot] = None

    def _release(self, slot: int) -> None:
        """Back to the end of the free list, whatever it held."""
        self._drop_hash(slot)
        if slot in self.lru:
            self.lru.remove(slot)
        for owner in self.owners[slot]:
            self.pinned[owner].remove(slot)
        self.state[slot], self.owners[slot] = "free", set()
        self.free_order.append(slot)

    def _add_owner(self, slot: int, owner: str) -> None:
        if owner not in self.owners[slot]:
            self.pinned[owner].append(slot)
        self.owners[slot].add(owner)
        if slot in self.lru:
            self.lru.remove(slot)

    def _remove_owner(self, slot: int, owner: str) -> None:
        if owner not in self.owners[slot]:
            return
        self.owners[slot].discard(owner)
        self.pinned[owner].remove(slot)
        if not self.owners[slot] and self.state[slot] == "ready":
            self.lru.append(slot)  # the most recently used end

    def _slots_in(self, state: str) -> list[int]:
        return [s for s in range(CAPACITY) if self.state[s] == state]

    # ---- rules
    @rule(n=st.integers(0, CAPACITY + 1), owner=st.sampled_from(OWNERS))
    def allocate(self, n: int, owner: str) -> None:
        before = {s: (self.state[s], self.hash[s], set(self.owners[s])) for s in range(CAPACITY)}
        if n > len(self.free_order) + len(self.lru):
            with pytest.raises(HostPoolExhausted):
                self.pool.allocate(n, owner)
            return
        slots = self.pool.allocate(n, owner)
        k = min(n, len(self.free_order))
        # Free slots first (oldest freed first), then the least recently used unowned ready slots.
        expected = self.free_order[:k] + self.lru[: n - k]
        assert slots == expected, (slots, self.free_order, self.lru)
        assert set(slots) <= set(self._slots_in("free")) | self._reclaimable(), "a pinned slot was taken"
        self.free_order, self.lru = self.free_order[k:], self.lru[n - k :]
        for s in slots:
            self._drop_hash(s)
            self.state[s] = "filling"
            self._add_owner(s, owner)
        for s in set(range(CAPACITY)) - set(slots):  # nothing else changed
            assert (self.state[s], self.hash[s], self.owners[s]) == before[s]

    @precondition(lambda self: "filling" in self.state)
    @rule(data=st.data(), h=st.sampled_from(HASHES))
    def commit(self, data: st.DataObject, h: bytes) -> None:
        slot = data.draw(st.sampled_from(self._slots_in("filling")))
        used = self.pool.commit(h, slot)
        if h in self.index:  # a shared prefix: the slot is freed, its owners move to the existing one
            existing = self.index[h]
            assert used == existing
            moved = set(self.owners[slot])
            self._release(slot)
            for owner in sorted(moved):
                self._add_owner(existing, owner)
        else:
            assert used == slot
            self.state[slot], self.hash[slot] = "ready", h
            self.index[h] = slot
            if not self.owners[slot]:
                self.lru.append(slot)

    @rule(slot=st.integers(0, CAPACITY - 1), h=st.sampled_from(HASHES))
    def commit_not_filling_is_refused(self, slot: int, h: bytes) -> None:
        if self.state[slot] == "filling":
            return
        with pytest.raises(ValueError):
            self.pool.commit(h, slot)

    @rule(slot=st.integers(0, CAPACITY - 1), owner=st.sampled_from(OWNERS))
    def pin(self, slot: int, owner: str) -> None:
        if self.state[slot] == "free":
            with pytest.raises(ValueError):
                self.pool.pin(slot, owner)
            return
        self.pool.pin(slot, owner)
        self._add_owner(slot, owner)

    @rule(slot=st.integers(0, CAPACITY - 1), owner=st.sampled_from(OWNERS))
    def unpin(self, slot: int, owner: str) -> None:
        self.pool.unpin(slot, owner)
        self._remove_owner(slot, owner)

    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner: str) -> None:
        held = list(reversed(self.pinned[owner]))  # the reverse of the pin order
        assert self.pool.release(owner) == len(held)
        for s in held:
            self._remove_owner(s, owner)

    def _invalidate(self, slot: int) -> None:
        """Freed, unless ready and owned: a copy may be reading it, so it only loses its hash."""
        if self.state[slot] == "ready" and self.owners[slot]:
            self._drop_hash(slot)
        elif self.state[slot] != "free":
            self._release(slot)

    @rule(slot=st.integers(0, CAPACITY - 1))
    def invalidate(self, slot: int) -> None:
        self.pool.invalidate(slot)
        self._invalidate(slot)

    @rule(h=st.sampled_from(HASHES))
    def drop(self, h: bytes) -> None:
        slot = self.index.get(h)
        assert self.pool.drop(h) == (slot is not None)
        if slot is not None:
            self._invalidate(slot)

    @rule()
    def reset(self) -> None:
        ready = self._slots_in("ready")
        assert self.pool.reset() == len(ready)
        for s in ready:
            if self.owners[s]:  # a load may be reading it: it keeps its owners, loses its hash
                self._drop_hash(s)
            else:
                self._release(s)

    @rule(slots=st.lists(st.integers(0, CAPACITY - 1), max_size=4))
    def touch(self, slots: list[int]) -> None:
        self.pool.touch(slots)
        self.touch_model(slots)

    @rule(chain=st.lists(st.sampled_from(HASHES), max_size=5), touch=st.booleans())
    def match_prefix(self, chain: list[bytes], touch: bool) -> None:
        expected: list[int] = []
        for h in chain:
            if h not in self.index:
                break
            expected.append(self.index[h])
        assert self.pool.match_prefix(chain, touch=touch) == expected
        if touch:
            self.touch_model(expected)

    def touch_model(self, slots: list[int]) -> None:
        for s in slots:
            if s in self.lru:
                self.lru.remove(s)
                self.lru.append(s)

    # ---- invariants
    @invariant()
    def slots_match_the_model(self) -> None:
        for s in range(CAPACITY):
            assert self.pool.state(s) == self.state[s], s
            assert self.pool.hash_of(s) == self.hash[s], s
            assert self.pool.owners(s) == frozenset(self.owners[s]), s
        for owner in OWNERS:
            assert self.pool.owned_by(owner) == sorted(s for s in range(CAPACITY) if owner in self.owners[s])

    @invariant()
    def accounting_adds_up_to_the_capacity(self) -> None:
        stats = self.pool.stats()
        free, filling, ready = (len(self._slots_in(x)) for x in ("free", "filling", "ready"))
        assert free + filling + ready == CAPACITY
        assert self.pool.num_free == stats["free"] == free  # no slot twice in the free list
        assert self.pool.num_filling == stats["filling"] == filling
        assert self.pool.num_reclaimable == stats["reclaimable"] == len(self._reclaimable())
        assert sorted(self.lru) == sorted(self._reclaimable()) and len(set(self.lru)) == len(self.lru)
        assert sorted(self.free_order) == self._slots_in("free")
        assert self.pool.available == free + len(self._reclaimable())
        pinned_ready = sum(1 for s in self._slots_in("ready") if self.owners[s])
        assert stats["free"] + stats["filling"] + stats["reclaimable"] + pinned_ready == CAPACITY
        assert stats["owners"] == len({o for s in range(CAPACITY) for o in self.owners[s]})

    @invariant()
    def lookups_return_only_committed_slots(self) -> None:
        for h in HASHES:
            slot = self.pool.lookup(h)
            assert slot == self.index.get(h), h
            if slot is not None:
                assert self.pool.state(slot) == "ready"
                assert self.pool.hash_of(slot) == h
        assert self.pool.num_ready == len(self.index)


HostPoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
test_host_pool_machine = HostPoolMachine.TestCase
