"""KV waste figures (runner_core.memory.fragmentation): hand-computed cases and properties of
the first-fit contiguous allocator simulation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner_core.memory.fragmentation import (
    FirstFitAllocator,
    FragmentationTracker,
    paged_figures,
    static_reservation_waste,
)


# ---- paged figures ------------------------------------------------------------------------
def test_paged_17_tokens_in_two_blocks_of_16():
    f = paged_figures([17], [2], 16)
    assert f["slots_allocated"] == 32 and f["slots_used"] == 17
    assert f["internal_fragmentation"] == pytest.approx(15 / 32)
    assert f["paged_waste"] == pytest.approx(15 / 32)
    assert f["kv_utilization"] == pytest.approx(17 / 32)


def test_paged_full_blocks_waste_nothing():
    f = paged_figures([32, 16], [2, 1], 16)
    assert f["internal_fragmentation"] == 0.0 and f["paged_waste"] == 0.0 and f["kv_utilization"] == 1.0


def test_paged_over_allocation_is_waste_not_internal_fragmentation():
    f = paged_figures([17], [3], 16)  # a whole third block owned ahead of need
    assert f["slots_allocated"] == 48
    assert f["internal_fragmentation"] == pytest.approx(15 / 48)
    assert f["paged_waste"] == pytest.approx(31 / 48)


def test_paged_several_sequences():
    f = paged_figures([17, 5, 16], [2, 1, 1], 16)  # empty slots 15 + 11 + 0 of 64
    assert f["slots_allocated"] == 64 and f["slots_used"] == 38
    assert f["internal_fragmentation"] == pytest.approx(26 / 64)
    assert f["paged_waste"] == pytest.approx(26 / 64)
    assert f["kv_utilization"] + f["paged_waste"] == pytest.approx(1.0)


def test_paged_empty_and_bad_input():
    assert paged_figures([], [], 16) == {"slots_allocated": 0, "slots_used": 0, "kv_utilization": 0.0,
                                         "internal_fragmentation": 0.0, "paged_waste": 0.0}
    with pytest.raises(ValueError):
        paged_figures([1, 2], [1], 16)


# ---- static reservation ---------------------------------------------------------------------
def test_static_reservation_waste():
    assert static_reservation_waste([100, 300], 512) == pytest.approx(1 - 400 / 1024)
    assert static_reservation_waste([512], 512) == 0.0
    assert static_reservation_waste([700], 512) == 0.0  # capped: a request never holds more than it reserved
    assert static_reservation_waste([], 512) == 0.0


# ---- first fit ------------------------------------------------------------------------------
def test_first_fit_places_frees_coalesces_and_refuses_fragmented():
    a = FirstFitAllocator(100)
    assert a.allocate("a", 30) and a.allocate("b", 30) and a.allocate("c", 40)
    assert [(s, n) for s, n, _ in a.allocations()] == [(0, 30), (30, 30), (60, 40)]
    assert a.reserved == 100 and a.external_fragmentation() == 0.0  # nothing free
    assert not a.allocate("d", 1) and a.free_slots == 0  # refused: full

    assert a.free("b") and a.holes() == [(30, 30)]
    assert a.external_fragmentation() == 0.0  # one hole
    assert a.allocate("e", 20) and a.allocations()[1][:2] == (30, 20)  # first fit: into b's hole
    assert a.free("a")
    assert a.holes() == [(0, 30), (50, 10)]
    assert a.external_fragmentation() == pytest.approx(1 - 30 / 40)

    assert not a.allocate("f", 35) and a.free_slots == 40  # refused: 40 slots free, but no run of 35
    assert a.external_fragmentation() > 0

    assert a.free("e")
    assert a.holes() == [(0, 60)]  # a, e and the old b hole merged
    assert a.external_fragmentation() == 0.0
    assert a.allocate("f", 35) and a.allocations()[0][:2] == (0, 35)
    assert not a.free("nope") and not a.free("a")


def test_first_fit_lowest_address_wins():
    a = FirstFitAllocator(100)
    for k in "abcd":
        a.allocate(k, 20)
    a.free("a")  # hole (0, 20)
    a.free("c")  # hole (40, 20), plus the tail (80, 20)
    assert a.allocate("x", 10) and a.allocations()[0] == (0, 10, "x")
    assert a.allocate("y", 15) and ("y" in a) and a.allocations()[2] == (40, 15, "y")


def test_first_fit_waste_and_in_use():
    a = FirstFitAllocator(100)
    a.allocate("a", 30)
    a.allocate("c", 40)
    tokens = {"a": 10, "c": 40, "gone": 99}
    assert a.in_use(tokens) == 50
    assert a.waste(tokens) == pytest.approx(1 - 50 / 70)
    assert a.in_use({"a": 500}) == 30  # a key never holds more than it reserved
    assert FirstFitAllocator(10).waste({}) == 0.0


def test_first_fit_rejects_bad_calls():
    a = FirstFitAllocator(10)
    a.allocate("a", 3)
    with pytest.raises(ValueError):
        a.allocate("a", 3)
    with pytest.raises(ValueError):
        a.allocate("b", 0)
    with pytest.raises(ValueError):
        FirstFitAllocator(0)
    assert not a.allocate("big", 11)


ops = st.lists(st.tuples(st.booleans(), st.integers(0, 11), st.integers(1, 40)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 120), ops=ops)
def test_first_fit_properties(capacity, ops):
    a = FirstFitAllocator(capacity)
    live: dict[int, int] = {}
    for is_alloc, key, size in ops:
        if is_alloc and key not in live:
            holes = a.holes()
            fits = [s for s, n in holes if n >= size]
            ok = a.allocate(key, size)
            assert ok == bool(fits)
            if ok:
                live[key] = size
                assert next(s for s, n, k in a.allocations() if k == key) == fits[0]  # lowest hole that fits
        else:
            assert a.free(key) == (key in live)
            live.pop(key, None)
        allocs = a.allocations()
        assert sorted(k for _, _, k in allocs) == sorted(live)
        assert all(n == live[k] for _, n, k in allocs)
        cursor = 0
        for s, n, _ in allocs:  # sorted, within bounds, never overlapping
            assert s >= cursor
            cursor = s + n
        assert cursor <= capacity
        holes = a.holes()
        assert a.reserved == sum(live.values())
        assert a.free_slots + a.reserved == capacity
        assert sum(n for _, n in holes) == a.free_slots
        assert all(h1[0] + h1[1] < h2[0] for h1, h2 in zip(holes, holes[1:]))  # coalesced: never adjacent
        assert 0.0 <= a.external_fragmentation() <= 1.0
        assert a.largest_hole() == max((n for _, n in holes), default=0)


# ---- tracker --------------------------------------------------------------------------------
def test_tracker_defers_retries_and_snapshots():
    t = FragmentationTracker(64)
    assert t.on_admit("a", 32) and t.on_admit("b", 16) and t.on_admit("c", 16)
    assert not t.on_admit("d", 16)  # pool full: deferred, not a fragmentation failure
    assert not t.on_admit("d", 16)  # idempotent
    assert t.num_failed == 1 and t.num_failed_fragmented == 0
    t.on_release("b")  # d takes b's place
    assert "d" in t.allocator and t.allocator.allocations()[1] == (32, 16, "d")

    snap = t.snapshot([("a", 20, 2), ("c", 5, 1), ("d", 1, 1)], block_size=16, max_model_len=64)
    assert snap["num_live"] == 3
    assert snap["slots_allocated"] == 64 and snap["slots_used"] == 26
    assert snap["paged_waste"] == pytest.approx(38 / 64)
    assert snap["static_reservation_waste"] == pytest.approx(1 - 26 / 192)
    assert snap["firstfit_reserved_slots"] == 64
    assert snap["firstfit_reserved_waste"] == pytest.approx(1 - 26 / 64)
    assert snap["firstfit_external_fragmentation"] == 0.0
    assert snap["firstfit_failed"] == 1 and snap["firstfit_num_deferred"] == 0
    assert snap["static_max_concurrency"] == 1
    assert all(isinstance(v, (int, float)) for v in snap.values())

    t.on_release("a")  # holes (0, 32) and (48, 16)
    t.on_release("c")
    assert not t.on_admit("e", 40)  # 48 free in total, no run of 40
    assert t.num_failed == 2 and t.num_failed_fragmented == 1
    snap = t.snapshot([("d", 3, 1)], 16, 64)
    assert snap["firstfit_external_fragmentation"] == pytest.approx(1 - 32 / 48)
    assert snap["firstfit_num_deferred"] == 1
    t.on_release("e")  # aborted while waiting for room
    t.on_release("d")
    assert t.snapshot([], 16, 64)["firstfit_num_deferred"] == 0 and t.allocator.reserved == 0
    assert not t.on_admit("huge", 65) and t.num_oversized == 1


def test_snapshot_of_many_sequences():
    """64 live sequences (what a step's observer sees; its cost per step is a benchmark figure,
    benchmarks/throughput.py): every figure agrees with its definition."""
    t = FragmentationTracker(64 * 512)
    live = [(i, 50 + 7 * i, -(-(50 + 7 * i) // 16)) for i in range(64)]
    for rid, tokens, _ in live:
        t.on_admit(rid, tokens + 100)
    snap = t.snapshot(live, 16, 512)
    tokens = sum(n for _, n, _ in live)
    assert snap["num_live"] == 64 and snap["firstfit_num_allocations"] == 64 and snap["firstfit_num_deferred"] == 0
    assert snap["static_reservation_waste"] == pytest.approx(1 - tokens / (64 * 512))
    assert snap["firstfit_reserved_waste"] == pytest.approx(1 - tokens / (tokens + 6400))
    assert snap["firstfit_external_fragmentation"] == 0.0  # placed back to back: one hole at the end
    assert snap == {**paged_figures([n for _, n, _ in live], [b for _, _, b in live], 16), "num_live": 64,
                    **t.contiguous_figures({rid: n for rid, n, _ in live}, 512)}


def test_tracker_membership():
    t = FragmentationTracker(16)
    t.on_admit("a", 16)
    t.on_admit("b", 8)
    assert "a" in t and "b" in t and "c" not in t
    t.on_release("b")
    t.on_release("a")
    t.on_release("never-seen")  # a no-op
    assert "a" not in t and "b" not in t and t.allocator.reserved == 0
