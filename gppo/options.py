"""Typed options: one validation for a setting however it arrives (command line, YAML, Python).

A configuration is a dataclass whose fields are declared with `option(default, help, group,
**constraints)`; the annotations are the types. `check(cls, values, source)` converts and checks
raw values with pydantic: command-line strings, YAML scalars and Python objects all pass the
same validation, so `--lr 1e-3`, YAML `lr: 1e-3` (a string under YAML 1.1) and `lr=1e-3` give
the same float. A refusal is a `ConfigError` naming the field, the value and a fix, in the words
of the source: "--lr: 'abc' is not a number; give e.g. --lr 0.0001". `add_arguments` builds the
argparse flags from the same fields, so the CLI, YAML files, `gppo train --resume` overrides and
`GPPOTrainerConfig.gppo_overrides` share one set of rules:

- booleans: true/false/yes/no/1/0 in any case, nothing else;
- numbers: finite, never a boolean; an int field refuses 2.5;
- "none"/"null" means None where the type allows None;
- lists are typed item by item; choices (a `Literal` type or `choices=`) name the closest one;
- constraints `ge`, `gt`, `le`, `lt`, and `check(value)`, a function that raises ValueError with
  what is wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
import yaml

from gppo.core import GPPOConfig, closest

NONE_WORDS = ("none", "null")
TRUE_WORDS = ("true", "yes", "1")
FALSE_WORDS = ("false", "no", "0")
CONSTRAINTS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


class ConfigError(ValueError):
    """A bad setting; the message names the field, the value and the fix."""


def option(
    default=dataclasses.MISSING,
    help: str = "",
    group: str | None = None,
    *,
    why: str | None = None,
    choices: tuple | None = None,
    check: Callable | None = None,
    example=None,
    short: str | None = None,
    **constraints,
):
    """A dataclass field with its help text, group and checks (see the module docstring).

    `why` is appended to constraint errors; `example` replaces the default in "give e.g. ...";
    `short` adds a one-letter flag (`-n`). No default: a required setting."""
    unknown = set(constraints) - set(CONSTRAINTS)
    if unknown:
        raise TypeError(f"option() got unknown constraints {sorted(unknown)}; use {list(CONSTRAINTS)}")
    metadata = {
        "help": help,
        "group": group,
        "why": why,
        "choices": choices,
        "check": check,
        "example": example,
        "short": short,
        "constraints": constraints,
    }
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=functools.partial(type(default), default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# ------------------------------------------------------------------------------ field specs
@dataclass(frozen=True)
class Spec:
    """What validation needs to know of one field."""

    name: str
    base: Any  # the annotation without None: int, float, bool, str, dict, list[X]
    item: Any  # the scalar type (the list's item type for lists)
    optional: bool
    is_list: bool
    default: Any
    metadata: Any  # the field's metadata: its help may be composed when read (GPPOConfig's lists the registries)
    group: str | None
    choices: tuple | None
    constraints: dict
    why: str | None
    check: Callable | None
    example: Any
    short: str | None

    @property
    def help(self) -> str:
        return self.metadata.get("help", "")

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


def _strip_none(annotation) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed); a union of several types is `object`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else object), len(args) < len(typing.get_args(annotation))
    return annotation, False


@functools.cache
def specs(cls) -> dict[str, Spec]:
    """The Spec of every field of the dataclass `cls` (GPPOConfig's fields carry only a help text)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        base, optional = _strip_none(hints[f.name])
        is_list = typing.get_origin(base) is list or base is list
        item = (typing.get_args(base) or (str,))[0] if is_list else base
        choices = f.metadata.get("choices")
        if typing.get_origin(item) is Literal:
            choices, item = typing.get_args(item), type(typing.get_args(item)[0])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = Spec(
            name=f.name,
            base=base,
            item=item,
            optional=optional,
            is_list=is_list,
            default=default,
            metadata=f.metadata,
            group=f.metadata.get("group"),
            choices=choices,
            constraints=f.metadata.get("constraints") or {},
            why=f.metadata.get("why"),
            check=f.metadata.get("check"),
            example=f.metadata.get("example"),
            short=f.metadata.get("short"),
        )
    return out


def _as_bool(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ValueError("not a boolean")


def _no_bool(value):
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


def _choice_word(value):
    """A YAML scalar read as the word it spells (`chat_template: no` is False: 'false')."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, (int, float)) else value


@functools.cache
def _adapter(item, choices: bool, constraints: tuple) -> pydantic.TypeAdapter | None:
    """The pydantic validator of one scalar; None for other types (objects pass unchanged and
    their owner checks them, as GPPOConfig does)."""
    if item not in (bool, int, float, str, dict):
        return None
    if item is bool:
        typed = Annotated[bool, pydantic.BeforeValidator(_as_bool)]
    elif item in (int, float):
        typed = Annotated[item, pydantic.BeforeValidator(_no_bool), pydantic.Field(**dict(constraints))]
    elif item is str and choices:
        typed = Annotated[str, pydantic.BeforeValidator(_choice_word)]
    else:
        typed = item
    return pydantic.TypeAdapter(typed, config=pydantic.ConfigDict(allow_inf_nan=False))


_PROBLEMS = {
    "float_parsing": "is not a number",
    "float_type": "is not a number",
    "int_parsing": "is not an integer",
    "int_type": "is not an integer",
    "int_from_float": "is not a whole number",
    "value_error": "is not {what}",
    "finite_number": "is not a finite number",
    "string_type": "is not text",
    "dict_type": "is not a mapping",
}
_WHAT = {bool: "true or false (or yes/no, 1/0)", int: "an integer", float: "a number", str: "text", dict: "a mapping"}


# ------------------------------------------------------------------------------ sources
@dataclass(frozen=True)
class Source:
    """Where values come from, to name a field and show a fix the way the user writes it."""

    kind: Literal["cli", "yaml", "python", "mapping"]
    where: str = ""  # the YAML file, the Python owner, the mapping's name

    def name(self, spec: Spec) -> str:
        return {
            "cli": f"-{spec.short}" if spec.short else f"--{spec.name}",
            "yaml": f"{spec.name} (in {self.where})",
            "python": f"{self.where}.{spec.name}" if self.where else spec.name,
            "mapping": f"{self.where}[{spec.name!r}]",
        }[self.kind]

    def example(self, spec: Spec) -> str:
        value = _example(spec)
        if self.kind == "cli":
            return self.name(spec) + " " + (" ".join(map(str, value)) if spec.is_list else _cli_word(value))
        if self.kind == "yaml":
            return f"{spec.name}: " + yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        if self.kind == "mapping":
            return f"{{{spec.name!r}: {value!r}}}"
        return f"{spec.name}={value!r}"


CLI = Source("cli")


def yaml_source(path) -> Source:
    return Source("yaml", str(path))


def _cli_word(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    text = str(value)
    return repr(text) if not text or any(c.isspace() or c in "{}$'\"" for c in text) else text


def _example(spec: Spec):
    if spec.example is not None:
        return spec.example
    if spec.default not in (None, dataclasses.MISSING, [], {}, ""):
        return spec.default
    if spec.choices:
        return [spec.choices[0]] if spec.is_list else spec.choices[0]
    scalar = {bool: True, int: 1, float: 0.5, str: spec.name.upper(), dict: {}}.get(spec.item, "VALUE")
    return [scalar] if spec.is_list else scalar


# ------------------------------------------------------------------------------ validation
def _refuse(spec: Spec, source: Source, problem: str, item: int | None = None) -> ConfigError:
    where = f" (item {item + 1})" if item is not None else ""
    return ConfigError(f"{source.name(spec)}{where}: {problem}; give e.g. {source.example(spec)}")


def _boolean_choices(spec: Spec) -> bool:
    """Choices that include 'true' and 'false' (e.g. auto|true|false) take booleans in any spelling."""
    return bool(spec.choices) and {"true", "false"} <= set(spec.choices)


def _convert_scalar(spec: Spec, value, source: Source, item: int | None = None):
    if _boolean_choices(spec) and isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        value = "true" if value.strip().lower() in TRUE_WORDS else "false"
    adapter = _adapter(spec.item, bool(spec.choices), tuple(sorted(spec.constraints.items())))
    if adapter is None:
        return value
    try:
        out = adapter.validate_python(value)
    except pydantic.ValidationError as err:
        error = err.errors()[0]
        kind = error["type"]
        if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
            key = {"greater_than_equal": "ge", "greater_than": "gt", "less_than_equal": "le", "less_than": "lt"}[kind]
            why = f": {spec.why}" if spec.why else ""
            where = f" (item {item + 1})" if item is not None else ""
            got = value if isinstance(value, str) else repr(value)
            raise ConfigError(
                f"{source.name(spec)}{where} must be {CONSTRAINTS[key]} {spec.constraints[key]} "
                f"(got {got}){why}; give e.g. {source.example(spec)}"
            ) from None
        problem = _PROBLEMS.get(kind, error["msg"].lower()).format(what=_WHAT.get(spec.item, "valid"))
        raise _refuse(spec, source, f"{value!r} {problem}", item) from None
    if spec.choices and out not in spec.choices:
        raise _refuse(
            spec, source, f"{value!r} is not one of {list(spec.choices)}{closest(out, spec.choices)}", item
        ) from None
    return out


def convert(spec: Spec, value, source: Source):
    """`value` as the type of `spec`, checked; ConfigError naming the field, the value and a fix."""
    if value is None or (spec.optional and isinstance(value, str) and value.strip().lower() in NONE_WORDS):
        if spec.optional:
            return None
        raise _refuse(spec, source, "a value is required (None is not allowed)")
    if spec.is_list:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise _refuse(spec, source, f"{value!r} is not a list")
        out = [_convert_scalar(spec, v, source, i) for i, v in enumerate(value)]
    else:
        out = _convert_scalar(spec, value, source)
    if out == "" and spec.default != "":
        raise _refuse(spec, source, "'' is empty")
    if spec.check is not None:
        try:
            spec.check(out)
        except ValueError as err:
            raise ConfigError(f"{source.name(spec)}: {value!r} {err}") from None
    return out


def refuse_ignored(config, names, unless: str) -> None:
    """ConfigError for the settings among `names` that differ from their defaults: they would be
    ignored (`unless` says when they apply)."""
    fields = specs(type(config))
    changed = [n for n in names if getattr(config, n) != fields[n].default]
    if changed:
        flags = ", ".join(f"--{n} {_shown(getattr(config, n))}" for n in changed)
        raise ConfigError(
            f"{flags} would be ignored: {'it applies' if len(changed) == 1 else 'they apply'} "
            f"{unless}; remove {'it' if len(changed) == 1 else 'them'}"
        )


def refuse_unknown(keys, valid, source: Source) -> None:
    """ConfigError for the first key not in `valid`, naming the closest valid one."""
    for key in keys:
        if key not in valid:
            where = f" in {source.where}" if source.kind == "yaml" else ""
            listing = f"valid keys: {', '.join(valid)}" if len(valid) <= 12 else "`--help` lists them all"
            raise ConfigError(f"unknown config key {key!r}{where}{closest(key, valid)}; {listing}")


def check(cls, values: dict, source: Source) -> dict:
    """The given `values` of dataclass `cls`, converted and checked (unknown keys refused)."""
    fields = specs(cls)
    refuse_unknown(values, list(fields), source)
    return {key: convert(fields[key], value, source) for key, value in values.items()}


def gppo_overrides(values: dict, source: Source) -> dict:
    """GPPOConfig field overrides converted by their types (`--delta_high 0.2`, YAML, JSON); the
    meaning of each point (choices, radii, which rule takes which parameter) is GPPOConfig's."""
    return check(GPPOConfig, values, source)


# ------------------------------------------------------------------------------ files
class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path, flag: str = "--config") -> dict:
    """The mapping in a YAML file; a missing file, a syntax error or a non-mapping is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag}: {str(path)!r} is not a file; give the path of a YAML file of `key: value` lines")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(
            f"{flag} {path}: {at}{err.problem or err.context}; fix the YAML syntax "
            "(one `key: value` per line; quote values holding ':' or '#')"
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"{flag} {path}: not readable as YAML ({err}); give a UTF-8 YAML file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{flag} {path}: holds a {type(data).__name__}, not a mapping; write one "
            "`key: value` per line (keys: the flags without the dashes)"
        )
    return {str(key): value for key, value in data.items()}


# ------------------------------------------------------------------------------ command line
# TRL's and verl's names of settings gppo names otherwise: a user's habit, answered with gppo's flag
PEER_FLAGS = {
    "learning_rate": ("TRL", "lr"),
    "num_generations": ("TRL", "group_size"),
    "max_completion_length": ("TRL", "max_new_tokens"),
    "beta": ("TRL", "kl_coef"),
    "num_train_epochs": ("TRL", "epochs"),
    "max_steps": ("TRL", "steps"),
    "num_iterations": ("TRL", "epochs"),
    "total_training_steps": ("verl", "steps"),
    "ppo_mini_batch_size": ("verl", "mini_batch_size"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises ConfigError (one error path) and names the closest flag of a typo."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise ConfigError(f"{message}; see `{self.prog} --help`")

    def parse(self, argv: list[str]) -> argparse.Namespace:
        args, extra = self.parse_known_args(argv)
        if extra:
            names = [opt[2:] for action in self._actions for opt in action.option_strings if opt.startswith("--")]
            word = next((e for e in extra if e.startswith("-")), extra[0])
            flag = word.split("=", 1)[0]
            if flag.startswith("-"):
                peer = PEER_FLAGS.get(flag.lstrip("-"))
                if peer is not None and peer[1] in names:
                    hint = f" ({peer[0]}'s name; gppo's flag is --{peer[1]})"
                else:
                    hint = closest(flag.lstrip("-"), names).replace("(did you mean '", "(did you mean --")
                    hint = hint.replace("'?)", "?)")
                self.error(f"unknown option {flag}{hint}")
            self.error(f"unexpected argument {word!r} (values follow their --flag)")
        return args


def _metavar(spec: Spec) -> str:
    if spec.choices:
        return "{" + ",".join(map(str, spec.choices)) + "}"
    return {bool: "BOOL", int: "INT", float: "FLOAT"}.get(spec.item, "TEXT")


def add_arguments(
    parser, cls, group_of: Callable[[Spec], Any] | None = None, default_text: str | None = None, exclude: tuple = ()
) -> None:
    """One --flag per field of `cls` but `exclude` (values stay strings: `check` converts them).

    `group_of(spec)` picks the argparse group (default: the parser); `default_text` replaces the
    default shown in the help (GPPOConfig's defaults come from the preset)."""
    for spec in specs(cls).values():
        if spec.name in exclude:
            continue
        target = group_of(spec) if group_of is not None else parser
        kwargs = dict(
            dest=spec.name,
            default=argparse.SUPPRESS,
            metavar=_metavar(spec),
            help=help_text(spec, default_text).replace("%", "%%"),
        )
        if spec.required:
            kwargs["required"] = True
        if spec.is_list:
            kwargs["nargs"] = "*" if spec.default == [] else "+"  # an empty list only where it is the default
        elif spec.item is bool or _boolean_choices(spec):
            kwargs.update(nargs="?", const="true")
        elif _adapter(spec.item, False, ()) is None:
            continue  # no command-line form (an object)
        flags = [f"--{spec.name}"] + ([f"-{spec.short}"] if spec.short else [])
        target.add_argument(*flags, **kwargs)


def help_text(spec: Spec, default_text: str | None = None) -> str:
    """The help of a flag, ending with its default once: a help that already says what happens by
    default ("default: ...", "unset: ...") gets no second "(default: ...)"."""
    if any(word in spec.help.lower() for word in ("default", "unset")):
        return spec.help
    return f"{spec.help} (default: {default_text or ('required' if spec.required else _shown(spec.default))})"


def given(args: argparse.Namespace, cls) -> dict:
    """The flags of `cls`'s fields that were given (raw strings), out of a parse of several configs."""
    return {k: v for k, v in vars(args).items() if k in specs(cls)}


def _shown(value) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).lower() if isinstance(value, bool) else str(value)
