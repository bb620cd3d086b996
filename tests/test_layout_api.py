"""`cohortgate.layout()`, the agent's declaration of its place in the mesh, and the rank
ranges reports use: a position from the rank in a named order or given outright, the
defaults a declaration leaves, and every mistake named in full."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.layout import layout, parse_order, position_from_rank


def test_a_position_comes_from_the_rank_in_the_order_named_or_is_given() -> None:
    megatron = layout(1, tp=2, dp=2)  # tp fastest
    assert megatron.sizes == {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 1}
    assert megatron.position == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 0}
    assert layout(1, tp=2, dp=2, order="dp-tp").position == {
        "tp": 0,
        "cp": 0,
        "ep": 0,
        "dp": 1,
        "pp": 0,
    }
    given = layout(3, tp=2, dp=2, position={"dp": 1})  # the rank is not read
    assert given.position == {"tp": 0, "cp": 0, "ep": 0, "dp": 1, "pp": 0}
    assert (megatron.config, megatron.dtype, megatron.quantization) == ("", "", "")
    assert layout(0, tp=1, quantization="fp8").quantization == "fp8"


@pytest.mark.parametrize(
    ("mistake", "said"),
    [
        (lambda: layout(0, foo=2), "unknown parallel axes ['foo']; use tp, cp, ep, dp, pp"),
        (
            lambda: parse_order("tp-foo"),
            "rank order 'tp-foo' must name each of tp, cp, ep, dp, pp at most once, "
            "fastest-varying first (e.g. 'tp-cp-ep-dp-pp')",
        ),
        (
            lambda: position_from_rank(4, {"tp": 2, "dp": 2}),
            "rank 4 is beyond the mesh {'tp': 2, 'dp': 2} (4 ranks)",
        ),
        (
            lambda: layout(0, tp=2).split("w", (3, 4), 0, 0, 2),
            "w: dimension 0 (3) is not divisible by 2",
        ),
        (lambda: ranges.expand("1-x"), "bad rank range '1-x': expected N or N-M"),
        (lambda: ranges.expand("5-2"), "bad rank range '5-2': end before start"),
    ],
    ids=["axis", "order", "beyond", "split", "range", "backwards"],
)
def test_a_mistake_in_a_declaration_is_named_in_full(
    mistake: Callable[[], object], said: str
) -> None:
    with pytest.raises(ValueError) as raised:
        mistake()
    assert str(raised.value) == said
