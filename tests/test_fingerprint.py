"""The fingerprints every rank must agree on (contract/fingerprint.py), at their bounds: how
deep a config flattens, which keys are left out, the report lines that name who differs and
who sent none, and the bounds a fingerprint from the network is held to, each at its limit
and one past it with its whole message."""

from __future__ import annotations

import pytest

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.fingerprint import (
    MAX_DEPTH,
    MAX_KEY,
    MAX_VALUE,
    check_fields,
    config_fields,
    disagreements,
    flatten,
)


def test_a_config_flattens_to_max_depth_and_keeps_what_is_deeper_as_its_json() -> None:
    nested: object = {"leaf": 1}
    for _ in range(MAX_DEPTH + 1):
        nested = {"a": nested}
    assert MAX_DEPTH == 8
    # the top and eight levels below it named; what is deeper is one value
    assert flatten({"top": nested}) == {"top.a.a.a.a.a.a.a.a": '{"a":{"leaf":1}}'}
    assert flatten({"x": {"y": 2}}, "config.") == {"config.x.y": "2"}
    assert flatten({"empty": {}}) == {"empty": "{}"}  # an empty mapping is a value


def test_private_and_metadata_keys_of_a_config_are_left_out() -> None:
    fields = config_fields({"_attn_internal": "sdpa", "transformers_version": "5.0", "n": 2})
    assert fields == {"n": "2"}


def test_who_sent_no_fingerprint_is_named_first_and_counted_with_the_fields() -> None:
    assert disagreements("config", {0: None, 1: None}) == ([], 0)  # none sent: nothing to say
    one = {0: None, 1: (("k", "1"),), 2: (("k", "2"),)}
    assert disagreements("config", one) == (
        ["config: not sent by rank 0", "config.k: 1 on rank 1, 2 on rank 2"],
        2,
    )
    many = {r: None if r % 2 == 0 else (("k", "1"),) for r in range(20)}
    assert disagreements("config", many) == (
        ["config: not sent by ranks 0,2,4,6,8,10,12,14 and 2 more runs"],
        1,
    )


def test_a_value_held_by_scattered_ranks_names_eight_runs_then_counts() -> None:
    values = {r: "a" if r % 2 == 0 else "b" for r in range(20)}
    assert ranges.by_value(values) == (
        "a on ranks 0,2,4,6,8,10,12,14 and 2 more runs, "
        "b on ranks 1,3,5,7,9,11,13,15 and 2 more runs"
    )


def test_a_fingerprint_from_the_network_is_taken_at_its_bounds() -> None:
    items = [(f"k{i}", "v") for i in range(9)] + [("x" * MAX_KEY, "y" * MAX_VALUE)]
    assert check_fields("config", items, limit=10) == tuple(sorted(items))


@pytest.mark.parametrize(
    ("items", "error", "said"),
    [
        (
            [("k", "v")] * 11,
            OverflowError,
            "config has 11 fields; the limit is max_fingerprint_fields=10",
        ),
        ([("", "v")], ValueError, f"config field name '' must be 1-{MAX_KEY} characters"),
        (
            [("x" * (MAX_KEY + 1), "v")],
            ValueError,
            f"config field name {'x' * 64!r} must be 1-{MAX_KEY} characters",
        ),
        (
            [("k" * 100, "y" * (MAX_VALUE + 1))],
            ValueError,
            f"config.{'k' * 64} is {MAX_VALUE + 1} characters; the limit is {MAX_VALUE} "
            "(send a long value as 'sha256:<hex>')",
        ),
    ],
    ids=["fields", "empty-name", "long-name", "long-value"],
)
def test_a_fingerprint_past_a_bound_is_refused_naming_it(
    items: list[tuple[str, str]], error: type[Exception], said: str
) -> None:
    with pytest.raises(error) as raised:
        check_fields("config", items, limit=10)
    assert str(raised.value) == said


def test_a_value_is_its_compact_sorted_json_up_to_max_value_then_its_sha256() -> None:
    import decimal
    import hashlib

    from cohortgate.coordinator.contract.fingerprint import canonical

    assert canonical({"b": [1, 2], "a": decimal.Decimal("1.5")}) == '{"a":"1.5","b":[1,2]}'
    at = "x" * (MAX_VALUE - 2)  # with its quotes, MAX_VALUE characters: kept
    assert canonical(at) == f'"{at}"'
    past = at + "x"
    assert canonical(past) == "sha256:" + hashlib.sha256(f'"{past}"'.encode()).hexdigest()
