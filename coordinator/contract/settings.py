"""Settings read from the environment, checked where they are read: a bad value is one line
naming the variable and what it accepts (shared by the agent and the command line)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping


class SettingError(ValueError):
    """A setting's value is not one it accepts; the message names the setting."""


def env_seconds(
    name: str, default: float, env: Mapping[str, str] | None = None, *, minimum: float = 0.0
) -> float:
    """`name` from the environment as a number of seconds above `minimum` (the default when
    unset or empty)."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(
            f"{name}={raw[:40]!r} is not a number; give seconds, e.g. {name}={default:g}"
        ) from None
    if not math.isfinite(value) or value <= minimum:
        raise SettingError(
            f"{name}={raw[:40]} must be a finite number of seconds above {minimum:g} "
            f"(default {default:g})"
        )
    return value


def token_text(name: str, raw: str | None) -> str | None:
    """A bearer token as read from `name` (often from a file, with its trailing newline):
    surrounding whitespace stripped, None when empty; inner spaces or control characters
    (which gRPC metadata cannot carry) refused naming the variable."""
    if raw is None:
        return None
    token = raw.strip()
    if not token:
        return None
    bad = next((c for c in token if not c.isprintable() or c.isspace()), None)
    if bad is not None:
        raise SettingError(
            f"{name} holds a character a token cannot carry ({bad!r} at position "
            f"{token.index(bad)}); give the token alone, one line with no spaces"
        )
    return token
