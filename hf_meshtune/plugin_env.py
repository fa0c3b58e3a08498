"""Knobs from the environment: ``MESHTUNE_<FIELD>`` for every mesh knob, parsed by its declared type.

``MeshPlugin`` (``accelerate.py``) re-declares every ``MeshArguments`` field with the ``FROM_ENV``
default (``env_backed``); a field left at it takes ``$MESHTUNE_<FIELD>`` when that is set and not
empty (``parse_env_value``), else the library default.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any

from ._validation import require
from .config import MeshArguments

__all__ = ["ENV_PREFIX", "FROM_ENV", "env_backed", "env_field", "parse_env_value"]

# MESHTUNE_<FIELD>; no field is called "mesh", so MESHTUNE_MESH stays the launcher's mesh shape.
ENV_PREFIX = "MESHTUNE_"
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


class _FromEnvironment:
    """Default of every env-backed plugin field: "not given" (None is a real value for some knobs)."""

    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV: Any = _FromEnvironment()


def env_field(default: Any, help: str) -> Any:
    return field(default=FROM_ENV, metadata={"help": help, "library_default": default})


def env_backed(cls: type) -> type:
    """Re-declare every ``MeshArguments`` field of ``cls`` with the ``FROM_ENV`` default.

    The fields keep their names, order, types and help; their validation stays ``MeshArguments``'.
    Applied before ``@dataclass``, which then sees the re-declarations as overrides.
    """
    annotations = cls.__dict__.get("__annotations__", {})
    for f in dataclasses.fields(MeshArguments):
        annotations[f.name] = f.type
        setattr(cls, f.name, env_field(f.default, f.metadata["help"]))
    cls.__annotations__ = annotations
    return cls


def parse_env_value(name: str, text: str, kind: Any) -> Any:
    """``text`` of environment variable ``name`` as a value of the field type ``kind``.

    bool: true/false/1/0/yes/no; ``list[int]``: comma-separated ints ("20,10"); ``X | None``: "none" → None,
    else X; a bad value raises a ``ValueError`` naming the variable, its value and the rule.
    """
    value = text.strip()
    members = typing.get_args(kind)
    optional = type(None) in members
    if optional:
        if value.lower() == "none":
            return None
        (kind,) = [member for member in members if member is not type(None)]
    if kind is bool:
        require(value.lower() in _TRUE + _FALSE, name, text, f"be one of {'/'.join(_TRUE + _FALSE)}")
        return value.lower() in _TRUE
    if kind in (int, float):
        rule = ("be an int" if kind is int else "be a number") + (" or 'none'" if optional else "")
        try:
            return kind(value)
        except ValueError:
            require(False, name, text, rule)
    if typing.get_origin(kind) is list:
        parts = [part.strip() for part in value.split(",")]
        rule = "be comma-separated ints (e.g. 20,10)" + (" or 'none'" if optional else "")
        require(all(p.lstrip("-").isdigit() for p in parts), name, text, rule)
        return [int(p) for p in parts]
    return value
