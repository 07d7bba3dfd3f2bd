"""The server's SVG charts: what is drawn where nothing is known, round axes, escaped labels, fixed colours."""

from __future__ import annotations

import re

import pytest

from llmgw.web import svgchart


def test_a_line_breaks_where_no_value_is_known_and_a_lone_point_is_a_dot():
    start, step = 1000.0, 60
    series = {start + step * i: 1.0 for i in (1, 2, 3, 7, 8)} | {start + step * 20: 4.0}
    svg = svgchart.lines(start, start + step * 30, [("m<1>", series)], step, "t")
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 1  # 1-3, 7-8, and 20 alone
    assert "m&lt;1&gt;" in svg and "<1>" not in svg
    assert ">5<" in svg  # the axis: a round number above the largest value


def test_a_flat_zero_is_drawn_and_a_fixed_axis_holds():
    svg = svgchart.lines(0, 600, [("idle", {60.0: 0.0, 120.0: 0.0})], 60, "t", top=100)
    assert "<polyline" in svg and ">100<" in svg
    # A value above the fixed axis raises it rather than leaving the chart.
    assert ">200<" in svgchart.lines(0, 600, [("busy", {60.0: 150.0})], 60, "t", top=100)


def test_colours_are_never_cycled_more_lines_are_said_not_drawn():
    groups = [(f"s{i}", {60.0: float(10 - i)}) for i in range(9)]
    svg = svgchart.lines(0, 600, groups, 60, "t")
    assert len(set(re.findall(r'fill="(#[0-9a-f]{6})"', svg))) == len(svgchart.COLOURS)
    assert "2 more not drawn (the largest are)" in svg and "s8" not in svg
    bars = svgchart.stacked_bars([0.0, 60.0], [(f"m{i}", {0.0: 1.0}) for i in range(9)], 60, "t")
    assert "3 others" in bars and "m8" not in bars


def test_axes_are_round_numbers_bytes_in_binary_units():
    assert [svgchart.round_up(v) for v in (0, 0.7, 1, 13, 2100, 0.03)] == [1, 1, 1, 20, 2500, 0.05]
    assert svgchart.round_up(4.2 * 2**30, binary=True) == 5 * 2**30
    assert svgchart.round_up(300, binary=True) == 500


def test_an_axis_is_found_for_any_finite_value_and_refused_for_what_no_float_holds():
    tiny = svgchart.round_up(5e-324)  # its power of ten is 0 as a float: StopIteration once
    assert 5e-324 <= tiny < 1e-300
    assert svgchart.round_up(1e308) == 1e308 and svgchart.round_up(-5) == 1
    for value in (float("inf"), float("nan"), float("-inf"), 1.7e308):
        with pytest.raises(ValueError, match="no axis reaches"):
            svgchart.round_up(value)
    # Two of 1e308 stacked are infinite: the chart is refused (the history section says so in a sentence).
    with pytest.raises(ValueError):
        svgchart.stacked_bars([0.0], [("a", {0.0: 1e308}), ("b", {0.0: 1e308})], 60, "t")
    assert "<circle" in svgchart.lines(0, 600, [("tiny", {60.0: 5e-324})], 60, "t")
