"""Flags generated from a settings model (edge/config.py, edge/relay_config.py,
cli/ops_settings.py): one flag per field, its help the field's description with its default
and variable, its type the field's. A field marked `POSITIONAL` is an argument instead (a
job id, a round), with no variable."""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from cohortgate.coordinator.edge.settings import env_var


def flag_of(name: str, model: type[BaseModel] | None = None) -> str:
    """`--field-name`, or the flag the field names (`json_out`: `--json`)."""
    field = model.model_fields.get(name) if model is not None else None
    extra = field.json_schema_extra if field is not None else None
    extra = extra if isinstance(extra, dict) else {}
    if extra.get("positional"):
        return name.upper()
    return "--" + str(extra.get("flag") or name).replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """Every field of `model` as a flag whose default is None (not given): the variable, then
    the field's default, apply unless the flag is given."""
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("positional"):
            parser.add_argument(
                name,
                nargs=None if field.is_required() else "?",
                type=int if field.annotation is int else str,
                default=None,
                help=field.description,
            )
            continue
        var = env_var(model, name)
        if field.is_required():
            said = f"required; ${var}"
        else:
            default = field.get_default(call_default_factory=True)
            shown = "off" if default in (None, "", False) else default
            said = f"default: {shown}; ${var}"
        help_text = f"{field.description or ''} ({said})".lstrip()
        kwargs: dict[str, Any] = {"help": help_text, "default": None}
        annotation = field.annotation
        args = typing.get_args(annotation)
        if annotation is bool:
            kwargs.update(action="store_const", const=True)
        elif typing.get_origin(annotation) is Literal:
            kwargs["choices"] = list(args)
        elif extra.get("repeat"):
            kwargs["action"] = "append"
        else:
            kind: Any = next((a for a in args if a is not type(None)), annotation)
            kwargs["type"] = kind
            metavar = {Path: "PATH", int: "N", float: "N"}.get(kind)
            if metavar is not None:
                kwargs["metavar"] = metavar
        parser.add_argument(flag_of(name, model), dest=name, **kwargs)


def given(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The flags the user gave, by field name; repeatable ones joined with ","."""
    out: dict[str, Any] = {}
    for name in model.model_fields:
        value = getattr(args, name, None)
        if isinstance(value, list):
            value = ",".join(value)
        if value is not None:
            out[name] = value
    return out


def settings_errors(
    model: type[BaseModel], flags: Mapping[str, Any], exc: ValidationError
) -> list[str]:
    """One line per problem, naming the flag given or the variable it came from."""
    lines = []
    for error in exc.errors():
        loc = "_".join(str(x) for x in error["loc"])
        known = loc in model.model_fields
        names = [env_var(model, loc), env_var(model, loc, old=True)] if known else []
        said = [v for v in names if v]
        var = next((v for v in said if os.environ.get(v)), said[0] if said else "")
        where = f"{flag_of(loc, model)}: " if loc else ""  # "": a check of several fields
        if loc and loc not in flags and var and os.environ.get(var):
            where = f"${var}={os.environ[var]!r}: "
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "missing":
            message = f"required: give it, or set ${var}"
        lines.append(f"{where}{message}")
    return lines
