"""What every rank of a job must agree on beyond its parameters (torch-free, agent-safe):
the model config, the training code and declared facts, each a set of named fields with
canonical values, compared field by field (TensorRT-LLM's SourceIdentity has this shape).

Canonical: nested mappings flatten to dotted names ("rope_parameters.rope_theta"), every
value is its JSON text with sorted keys, and a value longer than MAX_VALUE is replaced by
"sha256:<hex>", so equal things compare equal on every machine and the wire stays small.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.layout import CONFIG_METADATA_KEYS

# One fingerprint: sorted (field, canonical value) pairs. A tuple of strings: hashable, and
# the garbage collector does not track it.
Fields = tuple[tuple[str, str], ...]

# The fingerprints a join may carry, in the order reports show them: name -> what it is.
AGREED = {"config": "the model config", "code": "the training code", "facts": "declared facts"}
MAX_KEY = 256
MAX_VALUE = 1024
MAX_DEPTH = 8


def canonical(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    if len(text) > MAX_VALUE:
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    return text


def flatten(values: Mapping[str, Any], prefix: str = "", depth: int = 0) -> dict[str, str]:
    """Nested mappings as dotted names; any other value as its canonical JSON text."""
    out: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and depth < MAX_DEPTH:
            out.update(flatten(value, f"{name}.", depth + 1))
        else:
            out[name] = canonical(value)
    return out


def fields_of(values: Mapping[str, str]) -> Fields:
    return tuple(sorted(values.items()))


def config_fields(config: Any) -> dict[str, str]:
    """A model config's fields: a Hugging Face config (`to_dict()`; the model-specific names
    of its `attribute_map` shown by their standard names: GPT-2's `n_head` is
    `num_attention_heads`) or a mapping. Metadata keys (`_name_or_path`,
    `transformers_version`, ...) say where a config came from, not what the model is:
    left out."""
    data = config.to_dict() if callable(getattr(config, "to_dict", None)) else dict(config)
    standard = {v: k for k, v in getattr(type(config), "attribute_map", {}).items()}
    clean = {
        standard.get(k, k): v
        for k, v in data.items()
        if k not in CONFIG_METADATA_KEYS and not k.startswith("_")
    }
    return flatten(clean)


def digest(fields: Fields) -> str:
    return hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).hexdigest()


def disagreements(
    what: str, sent: Mapping[int, Fields | None], cap: int = 20
) -> tuple[list[str], int]:
    """Every field whose value is not the same on every rank, as report lines
    ("config.num_attention_heads: 4 on rank 0, 2 on ranks 1-3"; ranks that sent no such
    fingerprint first), capped at `cap` lines, and how many fields differ in all."""
    lines = []
    absent = sorted(r for r, f in sent.items() if f is None)
    partial = bool(absent) and len(absent) < len(sent)
    if partial:
        word = "rank" if len(absent) == 1 else "ranks"
        lines.append(f"{what}: not sent by {word} {ranges.compress_capped(absent, 8)}")
    # Equal fingerprints are equal tuples: grouped as they are, no hashing of their text.
    groups: dict[Fields, list[int]] = {}
    for r, f in sent.items():
        if f is not None:
            groups.setdefault(f, []).append(r)
    if len(groups) <= 1:
        return lines, len(lines)
    tables = [(dict(f), ranks) for f, ranks in groups.items()]
    names = sorted({k for table, _ in tables for k in table})
    differing = [k for k in names if len({table.get(k) for table, _ in tables}) > 1]
    for name in differing[:cap]:
        values = {r: table.get(name, "(absent)") for table, ranks in tables for r in ranks}
        lines.append(f"{what}.{name}: {ranges.by_value(values)}")
    return lines, len(differing) + partial


def check_fields(name: str, fields: Iterable[tuple[str, str]], limit: int) -> Fields:
    """A fingerprint from the network, within bounds (ValueError says which was passed)."""
    items = list(fields)
    if len(items) > limit:
        raise OverflowError(
            f"{name} has {len(items)} fields; the limit is max_fingerprint_fields={limit}"
        )
    for key, value in items:
        if not key or len(key) > MAX_KEY:
            raise ValueError(f"{name} field name {key[:64]!r} must be 1-{MAX_KEY} characters")
        if len(value) > MAX_VALUE:
            raise ValueError(
                f"{name}.{key[:64]} is {len(value)} characters; the limit is {MAX_VALUE} "
                "(send a long value as 'sha256:<hex>')"
            )
    return fields_of(dict(items))
