"""How a command reads its settings model: each field a flag (cli/flags.py) and a variable
(the model's `env_prefix` + FIELD_NAME, or the name the field gives); a flag wins over its
variable. Every command's model reads this way: serve (edge/config.py), relay
(edge/relay_config.py), status, watch and explain (cli/ops_settings.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, JsonValue

ENV_PREFIX = "COHORTGATE_"
REPEAT: dict[str, JsonValue] = {
    "repeat": True
}  # a flag given once per item; the items joined with ","
LOG_FORMAT = "auto: console on a tty, else JSON"
# An argument, not a flag (a job id): given on the command line only, never a variable.
POSITIONAL: dict[str, JsonValue] = {"positional": True}

Settings = TypeVar("Settings", bound=BaseModel)


def env_var(model: type[BaseModel], name: str, *, old: bool = False) -> str | None:
    """The variable of `model`'s field `name` (COHORTGATE_<FIELD> unless the field names its
    own); with old=True, the name it was read under before, if any."""
    extra = model.model_fields[name].json_schema_extra
    extra = extra if isinstance(extra, dict) else {}
    if extra.get("positional"):
        return None
    own = extra.get("deprecated_env" if old else "env")
    if own is None:
        return None if old else str(getattr(model, "env_prefix", ENV_PREFIX)) + name.upper()
    return ENV_PREFIX + str(own)


def from_env_and_flags(
    model: type[Settings],
    flags: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    warn: Callable[[str], None] = lambda said: print(f"cohortgate: {said}", file=sys.stderr),
) -> Settings:
    """Environment first, then every flag the user actually gave (not None) on top. A field
    still given under its old variable is read from it, and `warn` says the new name."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name in model.model_fields:
        var, old = env_var(model, name), env_var(model, name, old=True)
        raw = env.get(var) if var is not None else None
        if not raw and old is not None and env.get(old):
            raw = env[old]
            if flags.get(name) is None:
                warn(
                    f"{old} for the server is deprecated: use {var} ({old} keeps its meaning "
                    "for clients: agents, relays upstream and the CLI)"
                )
        if raw is not None and raw != "":
            values[name] = raw
    values.update({k: v for k, v in flags.items() if v is not None and k in model.model_fields})
    return model.model_validate(values)
