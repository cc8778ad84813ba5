"""The parallel map behind commit and checkout (ckstore/runtime/pipeline.py): order, bounded work, and the
grouping of small items into one task."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.runtime.pipeline import GROUP_MAX_ITEMS, grouped, ordered_map


@settings(max_examples=300)
@given(st.lists(st.integers(0, 5000), max_size=300), st.integers(1, 4096))
def test_groups_keep_every_item_in_order_within_their_limits(sizes: list[int], limit: int) -> None:
    groups = list(grouped(sizes, lambda n: n, limit))
    assert [n for g in groups for n in g] == sizes
    for g in groups:
        assert g and len(g) <= GROUP_MAX_ITEMS
        assert len(g) == 1 or sum(g) <= limit  # only an item larger than the limit travels alone over it


def test_ordered_map_yields_in_input_order_whatever_finishes_first() -> None:
    def slow_for_small(n: int) -> int:
        time.sleep(0.001 * (10 - n % 10))
        return n * n

    assert list(ordered_map(slow_for_small, range(40))) == [n * n for n in range(40)]


def test_ordered_map_bounds_the_items_in_flight() -> None:
    """At most ``max_inflight`` items are taken from the input ahead of what was yielded: memory
    stays at a few chunks whatever the checkpoint's size."""
    pulled = 0

    def source():  # type: ignore[no-untyped-def]
        nonlocal pulled
        for n in range(50):
            pulled += 1
            yield n

    ahead = []
    for consumed, n in enumerate(ordered_map(lambda n: n, source(), workers=2, max_inflight=3), start=1):
        assert n == consumed - 1
        ahead.append(pulled - consumed)
    assert max(ahead) <= 3 and len(ahead) == 50


def test_collection_paused_nests_and_restores_the_interpreters_setting() -> None:
    import gc

    from ckstore.runtime.pipeline import collection_paused

    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            with collection_paused():
                with collection_paused():
                    assert not gc.isenabled()
                assert not gc.isenabled()  # the outer block still runs
            assert gc.isenabled() == enabled
            try:
                with collection_paused():
                    raise KeyError("x")
            except KeyError:
                pass
            assert gc.isenabled() == enabled
        finally:
            gc.enable()
