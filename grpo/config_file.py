"""--config FILE: config keys read from a JSON file (or YAML, when PyYAML is installed),
turned into the same ``key -> value`` overrides the command line gives, so a file and the
flags go through one mechanism (grpo/config.py: apply_overrides, validate) and the flags,
applied after the file, win.

The file is a mapping, the shape of a run's saved ``config_<phase>.json``:

    {"optim": {"lr": 0.001}, "sampling": {"G": 4},       sections, as --optim.lr --sampling.G
     "run.eval_every": 10,                               or a dotted key
     "A": {"phase": {"steps": 20}}}                      a phase's own keys, as --A.phase.steps

Top-level keys apply as the same flags without a phase prefix would (phase.* and
rewards.weights to the requested phase, the rest to every phase); a top-level warmup, A, B or C
holds keys for that phase alone. A value is the field's type (a list for a tuple, a mapping
for a dict) or a string read as the flag's text would be ("1e-3" in YAML, where 1e-3
without a dot is a string). ``phase.name``, saved in every config file, must name the phase
it applies to (the requested one at the top level): config_A.json does not silently run as
phase B. Every refusal is one ConfigError line naming the file and the key.
"""

from __future__ import annotations

import importlib.util
import json
import typing
from pathlib import Path
from typing import Any

from grpo.config import TrainConfig
from grpo.config_checks import PHASES
from grpo.errors import ConfigError
from grpo.overrides import _dict_key, _fields, _parse_value, _resolve_key

YAML_SUFFIXES = (".yaml", ".yml")


def read_config_file(path: str, requested: str) -> dict[str, Any]:
    """The file's keys as overrides ('section.field' or 'A.section.field' -> value), checked
    against the config's fields and types; ``requested``: the --phase of this command."""
    raw = _parse(Path(path))
    if raw is None:  # an empty YAML file sets nothing
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: the file holds a {type(raw).__name__}, not a mapping of sections "
                          "(write e.g. {\"optim\": {\"lr\": 0.001}})")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        key = str(key)
        if key in PHASES:
            if not isinstance(value, dict):
                raise ConfigError(f"--config {path}: {key} holds {value!r}: a phase's keys are a mapping of sections, "
                                  f"e.g. {key}: {{phase: {{steps: 20}}}}")
            for name, v in _section_keys(value, path, f"{key}."):
                out[f"{key}.{name}"] = _checked_name(v, name, key, path)
        else:
            for name, v in _section_keys({key: value}, path, ""):
                out[name] = _checked_name(v, name, requested, path)
    return {k: v for k, v in out.items() if not k.endswith("phase.name")}


def _parse(path: Path) -> Any:
    """The file's content; a file that cannot be read or parsed is one line with its line and reason."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror or err}); "
                          "name an existing JSON or YAML file") from None
    if path.suffix.lower() in YAML_SUFFIXES:
        if importlib.util.find_spec("yaml") is None:
            raise ConfigError(f"--config {path}: reading YAML needs PyYAML: pip install 'vlgrpo[yaml]' (or pip install "
                              "pyyaml), or write the file as JSON")
        import yaml  # optional package: imported only for a YAML file

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}" if mark is not None else "line ?"
            reason = " ".join(str(p) for p in (getattr(err, "context", None), getattr(err, "problem", None)) if p) or str(err)
            raise ConfigError(f"--config {path}: {where}: {' '.join(reason.split())}; fix the YAML") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        hint = "" if path.suffix.lower() == ".json" else " (a file named .yaml or .yml is read as YAML)"
        raise ConfigError(f"--config {path}: line {err.lineno}: {err.msg} (column {err.colno}); fix the JSON{hint}") from None


def _section_keys(mapping: dict, path: str, where: str):
    """('section.field', value) for each entry: a section holding its fields, or a dotted key."""
    sections = _fields(TrainConfig())
    for key, value in mapping.items():
        key = str(key)
        if "." in key:
            yield key, value
        elif key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"--config {path}: {where}{key} holds {value!r}: a section is a mapping of its fields, "
                                  f"e.g. {key}: {{{next(iter(_fields(getattr(TrainConfig(), key))))}: ...}}")
            for name, v in value.items():
                yield f"{key}.{name}", v
        else:
            top = "" if where else f" or a phase ({', '.join(PHASES)})"
            raise ConfigError(f"--config {path}: unknown section {where}{key!r}: use a section "
                              f"({', '.join(sections)}){top}, or a dotted key such as optim.lr")


def _checked_name(value: Any, key: str, phase: str, path: str) -> Any:
    """phase.name must be the phase the key applies to; every other key is checked by _checked."""
    if key.replace("-", "_") == "phase.name":
        if value != phase:
            raise ConfigError(f"--config {path}: phase.name is {value!r} where it applies to phase {phase}: this "
                              f"is phase {value}'s config, so run it with --phase {value} (or drop phase.name)")
        return value
    return _checked(value, key, path)


def _checked(value: Any, key: str, path: str) -> Any:
    """The value in the type of its field, or one line naming the key. A string is kept as
    it is: override() parses it exactly as it parses the flag's text."""
    cfg = TrainConfig()
    try:
        section, name = _resolve_key(cfg, key)
    except ConfigError as err:
        raise ConfigError(f"--config {path}: {err}") from None
    typ = typing.get_type_hints(type(section))[name]
    if isinstance(value, str):
        if typ is not str:
            try:
                _parse_value(value, typ, key)
            except ConfigError as err:
                raise ConfigError(f"--config {path}: {err}") from None
        return value
    origin, number = typing.get_origin(typ), (int, float)
    bad = f"--config {path}: {key}={value!r}: expected "
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(bad + "true or false")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(bad + "an integer")
    if typ is float:
        if isinstance(value, number) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(bad + "a number")
    if origin is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(bad + "a list of names (or one comma-separated string)")
    if origin is dict:
        ktyp, vtyp = typing.get_args(typ)
        if isinstance(value, dict):
            try:
                out = {_dict_key(ktyp, str(k)): v for k, v in value.items()}
            except ValueError as err:
                raise ConfigError(bad + f"a mapping whose keys are {_key_hint(ktyp)}; {err} is not") from None
            if all(isinstance(v, str) if vtyp is str else isinstance(v, number) and not isinstance(v, bool)
                   for v in out.values()):
                return {k: float(v) if vtyp is float else v for k, v in out.items()}
        raise ConfigError(bad + ("a mapping of names to strings" if vtyp is str else "a mapping of names to numbers"))
    raise ConfigError(bad + "a string")


def _key_hint(ktyp: Any) -> str:
    return "names" if ktyp is str else "stages 1, 2, 3 or all"
