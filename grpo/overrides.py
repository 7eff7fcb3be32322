"""Overrides: ``--key value`` onto a TrainConfig, the --help listing of every key, a saved config read back.

A key is ``section.field`` (``--sampling.G 4``) or a field name that is unique across
sections (``--G 4``); an unknown key is refused with the nearest known ones. Values are
parsed by the field's type: ints, floats, bools (true/false/1/0/yes/no), strings, tuples
(comma separated) and dicts (``name=value,name=value``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import typing
from typing import Any, Literal

from grpo.config import TrainConfig
from grpo.errors import ConfigError


def _fields(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def _resolve_key(cfg: TrainConfig, key: str) -> tuple[Any, str]:
    """Map 'section.field' or a unique 'field' to (section object, field name)."""
    key = key.replace("-", "_")
    sections = _fields(cfg)
    if "." in key:
        sec, name = key.split(".", 1)
        if sec in sections and name in _fields(getattr(cfg, sec)):
            return getattr(cfg, sec), name
    else:
        owners = [s for s in sections if key in _fields(getattr(cfg, s))]
        if len(owners) == 1:
            return getattr(cfg, owners[0]), key
        if len(owners) > 1:
            raise ConfigError(f"--{key} is ambiguous: write one of " + ", ".join(f"--{s}.{key}" for s in owners))
    known = sorted(f"{s}.{n}" for s in sections for n in _fields(getattr(cfg, s)))
    near = difflib.get_close_matches(key, known, n=3, cutoff=0.7)
    hint = f"did you mean {' or '.join('--' + k for k in near)}? " if near else ""
    raise ConfigError(f"unknown config key --{key}; {hint}known keys: {', '.join(known)}")


def _parse_value(text: str, typ: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
        if typ is str:
            return text
        if origin is tuple:
            return tuple(p.strip() for p in text.split(",") if p.strip())
        if origin is dict:
            ktyp, vtyp = typing.get_args(typ)
            out = {}
            for item in filter(None, (p.strip() for p in text.split(","))):
                k, v = item.split("=", 1)
                out[_dict_key(ktyp, k.strip())] = vtyp(v)
            return out
    except ValueError:
        pass
    hint = {bool: "true or false", int: "an integer", float: "a number"}.get(
        typ, "name=value,name=value" if origin is dict else str(typ))
    raise ConfigError(f"--{key} {text!r}: expected {hint}")


def _dict_key(ktyp: Any, text: str) -> Any:
    """A dict key of type ``ktyp``: str, int, or a union of int and literal names (the stage
    mixture's 1, 2, 3 and "all"); ValueError when it is none of them."""
    options = typing.get_args(ktyp) if typing.get_origin(ktyp) is not None else (ktyp,)
    for option in options:
        if typing.get_origin(option) is Literal:
            if text in typing.get_args(option):
                return text
        else:
            try:
                return option(text)
            except ValueError:
                pass
    raise ValueError(text)


def override(cfg: TrainConfig, key: str, value: str | Any) -> None:
    """Set one field from a CLI string (parsed by the field's type) or a Python value."""
    section, name = _resolve_key(cfg, key)
    hints = typing.get_type_hints(type(section))
    typ = hints[name]
    if isinstance(value, str) and typ is not str:
        value = _parse_value(value, typ, key)
    setattr(section, name, value)


def apply_overrides(cfg: TrainConfig, pairs: dict[str, Any]) -> TrainConfig:
    for k, v in pairs.items():
        override(cfg, k, v)
    return cfg


# Options that may be given more than once: each occurrence adds its NAME=value items (a later
# one for the same NAME wins). Every other option given twice keeps its last value.
REPEATABLE = ("rewards.extra", "extra")


def parse_override_args(argv: list[str]) -> dict[str, str]:
    """['--sampling.G', '4', '--lr=1e-3'] -> {'sampling.G': '4', 'lr': '1e-3'}; a repeated
    ``--rewards.extra`` (any phase prefix) joins its values with commas."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options are written --key value")
        if "=" in arg:
            k, v = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a value: write {arg} VALUE")
            k, v = arg[2:], argv[i + 1]
            i += 2
        repeatable = any(k == r or k.endswith("." + r) for r in REPEATABLE)
        out[k] = f"{out[k]},{v}" if repeatable and k in out else v
    return out


def describe_fields() -> str:
    """A help listing of every key, its default and its docstring (for --help)."""
    import ast
    import inspect

    lines = []
    cfg = TrainConfig()
    for sec_name in _fields(cfg):
        section = getattr(cfg, sec_name)
        docs = _field_docs(type(section), ast, inspect)
        lines.append(f"  [{sec_name}]")
        for name in _fields(section):
            default = getattr(section, name)
            if isinstance(default, tuple):
                default = ",".join(default)
            elif isinstance(default, dict):
                default = ",".join(f"{k}={v}" for k, v in default.items())
            lines.append(f"    --{sec_name}.{name} (default {default})")
            if docs.get(name):
                lines.append(f"        {docs[name]}")
    return "\n".join(lines)


def _field_docs(cls: type, ast: Any, inspect: Any) -> dict[str, str]:
    """Read the one-line docstring that follows each field in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(getattr(nxt, "value", None), ast.Constant)):
            docs[node.target.id] = re.sub(r"\s*\n\s*", " ", str(nxt.value.value).strip())  # a wrapped docstring: one line
    return docs


def from_json(text: str) -> TrainConfig:
    """Rebuild a TrainConfig from its saved JSON (run directory compatibility checks)."""
    raw = json.loads(text)
    cfg = TrainConfig()
    if not isinstance(raw, dict):
        raise ConfigError(f"a saved config must be a JSON object of sections, got a {type(raw).__name__}")
    for sec_name, values in raw.items():
        # a checkpoint made by another version (or edited) must not end in an AttributeError
        if sec_name not in _fields(cfg) or not isinstance(values, dict):
            raise ConfigError(f"saved config has an unknown section {sec_name!r} (sections: {', '.join(_fields(cfg))})")
        section = getattr(cfg, sec_name)
        hints = typing.get_type_hints(type(section))
        unknown = sorted(set(values) - set(hints))
        if unknown:
            raise ConfigError(f"saved config section {sec_name!r} has unknown keys {unknown}: "
                              "was it written by another vlgrpo version?")
        for name, value in values.items():
            if typing.get_origin(hints[name]) is tuple:
                value = tuple(value)
            elif typing.get_origin(hints[name]) is dict:
                ktyp = typing.get_args(hints[name])[0]
                try:
                    value = {_dict_key(ktyp, k): v for k, v in value.items()}
                except ValueError as err:
                    raise ConfigError(f"saved config {sec_name}.{name} has an unknown key {err}") from None
            setattr(section, name, value)
    return cfg
