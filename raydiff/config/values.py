"""How a value from YAML or the command line becomes a config key's type (`coerce`; `read_override` for `--set`
text, `read_yaml` for list items), and how a type is named in an error and in docs/configuration.md
(`describe_type`, `shown`).

Why apart from the schema: the schema says what each key is; this says what a typed key accepts, the same for
every key (numbers finite, integers whole, literals exact, a single value for a one-item list, a string key's
`--set` text taken as typed).
"""

from __future__ import annotations

import math
import re
import reprlib
import types
from typing import Any, Literal, Union, get_args, get_origin

import yaml


def describe_type(hint: Any) -> str:
    """The type as a user reads it: `auto | true | false`, `integer | null`, `list of finite numbers`."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join("null" if a is type(None) else describe_type(a) for a in args)
    if origin is tuple:
        return "list of finite numbers" if args[0] is float else f"list of {describe_type(args[0])}"
    return {int: "integer", float: "a finite number", bool: "true | false", str: "string"}.get(hint, str(hint))


_SHOWN = reprlib.Repr()  # bounded: a few YAML aliases nest a value whose full repr takes gigabytes
_SHOWN.maxstring = _SHOWN.maxother = 300
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 12, 12, 12


def shown(value: Any) -> str:
    """A value as a one-line error names it: `null` for None (as a YAML file and `--set` write it), else its repr,
    abridged (`...`) where long."""
    return "null" if value is None else _SHOWN.repr(value)


def is_text(hint: Any) -> bool:
    """Whether a key holds text only: `str` or `str | None` (names, paths, URIs, URLs). A key that takes a string
    among other things (`train.compile`: auto, true, false or a backend's name) is not: its `--set` value is YAML."""
    if hint is str:
        return True
    return get_origin(hint) in (Union, types.UnionType) and set(get_args(hint)) == {str, type(None)}


NULL_TEXTS = frozenset({"~", "null", "Null", "NULL"})  # YAML's spellings of null


def read_override(raw: str, hint: Any) -> Any:
    """The value of `--set KEY=<raw>` for a key of type `hint`, for `coerce` to convert (or refuse).

    A text key (`is_text`) takes `raw` as typed (stripped), not as YAML, whose 1.1 rules would change it (`12:30`
    is 750, `0123` is 83, `2024-01-15` a date): only YAML's nulls are null (refused where the key takes none),
    empty is the empty text (which its rule refuses; `parse_override` refuses it where the key takes null: an
    unset shell variable, not a choice of none), and a value wholly in
    quotes is the quoted text (`log.wandb_project='null'`). Any other key reads `raw` as YAML; text that is not
    YAML (`5,*`) is kept as written, for the key's type to take or refuse."""
    if not is_text(hint):
        try:
            return read_yaml(raw) if raw.strip() else None
        except ValueError:
            return raw
    text = raw.strip()
    if text in NULL_TEXTS:
        return None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        try:
            quoted = read_yaml(text)
        except ValueError:  # `'a' 'b'`: not one quoted string, so text
            quoted = None
        if isinstance(quoted, str):
            return quoted
    return text


def coerce(value: Any, hint: Any) -> Any:
    """Convert `value` to `hint` or raise ValueError. Accepts what YAML and the command line produce."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except ValueError:
                pass
        raise ValueError
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise ValueError
    if origin is tuple:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith(("[", "(")) != text.endswith(("]", ")")):  # `[1,2`: a list cut short, not [1, 2]
                raise ValueError
            value = [v for v in text.strip("[]() ").split(",") if v.strip()]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]  # a single value is a one-item list
        if not isinstance(value, (list, tuple)):
            raise ValueError
        return tuple(coerce(read_yaml(v) if isinstance(v, str) else v, args[0]) for v in value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError
    if hint is int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
            return int(value)
        raise ValueError
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError
        try:
            number = float(value)  # YAML 1.1 reads "1e-4" as a string
        except OverflowError:  # an int of hundreds of digits
            raise ValueError from None
        if not math.isfinite(number):  # inf or nan would train NaNs, or never stop waiting
            raise ValueError
        return number
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError
    raise TypeError(f"unsupported config type {hint}")


# What yaml.safe_load raises on text it cannot read: YAMLError for syntax, and for a malformed tagged scalar
# whatever PyYAML's constructor meets (`!!float x` ValueError, `!!bool x` KeyError, `!!int _` IndexError,
# `!!timestamp x` AttributeError).
YAML_ERRORS = (yaml.YAMLError, ValueError, LookupError, AttributeError, TypeError)


class DecimalLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but numbers read as YAML 1.2 and people read them: `064` is 64 (YAML 1.1: octal 52),
    and `1:30` is text (1.1: 90, base 60), which a number key then refuses."""


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
DecimalLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
DecimalLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0b[0-1_]+|0x[0-9a-fA-F_]+|[0-9][0-9_]*)$"),
                                    list("-+0123456789"))
DecimalLoader.add_implicit_resolver(_FLOAT, re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?
    |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


def _decimal_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text.removeprefix("+"))
    base = {"0b": 2, "0x": 16}.get(digits[:2], 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


DecimalLoader.add_constructor(_INT, _decimal_int)


def read_yaml(text: str) -> Any:
    """`text` read as YAML (`DecimalLoader`); ValueError where it cannot be (`*`, `'4`, `[3`, `!!float x`)."""
    try:
        return yaml.load(text, Loader=DecimalLoader)  # noqa: S506 - a SafeLoader
    except YAML_ERRORS:
        raise ValueError(text) from None
