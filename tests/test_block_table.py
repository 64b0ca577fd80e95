"""The runner's persistent block table: rows handed out and reused, grown by use, gathered in step order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoinfer.model_runner.block_table import BlockTable


def ids(table: BlockTable, row: int) -> list[int]:
    """One row's block ids (a gather of that row alone is as wide as its blocks)."""
    return table.gather(np.array([row]))[0].tolist()


def test_rows_hold_their_blocks_and_are_reused_after_free():
    table = BlockTable(num_rows=2, num_cols=2)
    a, b = table.add([5, 6]), table.add([7])
    table.append(b, [8, 9, 10])  # past the width: the table widens
    assert ids(table, a) == [5, 6] and ids(table, b) == [7, 8, 9, 10]
    table.free(a)
    c = table.add([1])
    assert c == a and ids(table, c) == [1]  # the row's old ids are not its blocks
    d = table.add([2, 3])  # past the rows: the table doubles
    assert d not in (b, c) and ids(table, d) == [2, 3]
    gathered = table.gather(np.array([d, b]))
    assert gathered.dtype == np.int32 and gathered.shape == (2, 4)
    assert gathered[0, :2].tolist() == [2, 3] and gathered[1].tolist() == [7, 8, 9, 10]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "append", "free"]), st.integers(0, 7),
                          st.lists(st.integers(0, 999), max_size=5)), max_size=60))
def test_matches_a_list_per_request(ops):
    """Any sequence of adds, appends and frees: every live row gathers exactly its request's blocks."""
    table, expected = BlockTable(num_rows=1, num_cols=1), {}
    for op, pick, ids in ops:
        live = sorted(expected)
        if op == "add" or not live:
            row = table.add(ids)
            assert row not in expected  # never a live request's row
            expected[row] = list(ids)
        elif op == "append":
            row = live[pick % len(live)]
            table.append(row, ids)
            expected[row] += ids
        else:
            row = live[pick % len(live)]
            table.free(row)
            del expected[row]
        rows = sorted(expected)
        if rows:
            gathered = table.gather(np.array(rows))
            assert gathered.shape == (len(rows), max(len(expected[r]) for r in rows))
            for i, r in enumerate(rows):
                assert gathered[i, : len(expected[r])].tolist() == expected[r]
