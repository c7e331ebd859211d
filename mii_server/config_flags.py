"""Command-line flags derived from pydantic config fields, so the CLI states no default of its own.

``add_field_flags(parser, Model, space)`` adds one flag per field (``max_length`` -> ``--max-length``,
nested models flattened: ``kv_cache.num_blocks`` -> ``--kv-cache-num-blocks``), typed from the
annotation: ``bool`` -> ``--x / --no-x``, ``Literal`` -> choices, ``int`` / ``float`` / ``str`` as such
(``none`` for a field that may be None), ``list[str]`` a comma list, anything else JSON. The help is
the field's description and default. A flag not given leaves its field out, so a config file or the
field's own default decides; ``given(args, space)`` returns the given ones as (nested) field values.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def add_field_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    space: str,
    *,
    fields: Collection[str] | None = None,
    skip: Collection[str] = (),
    aliases: Mapping[str, Sequence[str]] | None = None,
    _under: str = "",
) -> None:
    """Add a flag for each of ``model``'s fields (only ``fields`` when given, never ``skip``).

    ``space`` keeps the values of different models apart in the namespace; ``aliases`` maps a field
    path (``"port_number"``, ``"kv_cache.num_blocks"``) to more option strings for it (a bool's
    ``--x`` alias also gets ``--no-x``). A field without a default is a required flag.
    """
    for name, field in model.model_fields.items():
        if name in skip or (fields is not None and name not in fields):
            continue
        path = _under + name
        base, optional = _unwrap_optional(field.annotation)
        if isinstance(base, type) and issubclass(base, BaseModel):
            add_field_flags(parser, base, space, aliases=aliases, _under=path + ".")
            continue
        names = ["--" + path.replace(".", "-").replace("_", "-"), *(aliases or {}).get(path, ())]
        kwargs: dict[str, Any] = {"dest": f"{space}:{path}", "default": argparse.SUPPRESS, "help": _help(field)}
        if field.is_required():
            kwargs["required"] = True
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(base) is Literal:
            choices = list(typing.get_args(base))
            kind = type(choices[0])
            metavar = "{" + ",".join(map(str, choices + (["none"] if optional else []))) + "}"
            kwargs.update(choices=choices + ([None] if optional else []), type=_or_none(kind) if optional else kind)
            kwargs["metavar"] = metavar
        elif base in (int, float, str):
            kwargs.update(type=_or_none(base) if optional else base, metavar=name.upper())
        elif typing.get_origin(base) is list and typing.get_args(base) == (str,):
            kwargs.update(type=_comma_list, metavar="A,B,...")
        else:
            kwargs.update(type=_json_or_text, metavar="JSON")
        parser.add_argument(*names, **kwargs)


def given(args: argparse.Namespace, space: str) -> dict[str, Any]:
    """The flags of ``space`` given on the command line, as field values (nested models as dicts)."""
    out: dict[str, Any] = {}
    prefix = space + ":"
    for dest, value in vars(args).items():
        if dest.startswith(prefix):
            *parents, leaf = dest[len(prefix) :].split(".")
            node = out
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
    return out


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s values on top; dicts on both sides merge key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without ``None``, whether None was allowed)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        if len(members) == 1:
            return members[0], optional
        return typing.Union[tuple(members)], optional  # noqa: UP007 - built from a runtime tuple
    return annotation, False


def _help(field: FieldInfo) -> str:
    text = (field.description or "").replace("%", "%%")
    if not field.is_required() and field.default_factory is None:
        default = field.default
        shown = "none" if default is None else repr(default) if default == "" else json.dumps(default) if isinstance(default, list) else default
        text += f" (default: {shown})"
    return text


def _or_none(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its errors
    return parse


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:  # a plain word (device_map's "auto")
        return text
