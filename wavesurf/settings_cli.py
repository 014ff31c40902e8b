"""Settings dataclasses that make their own command-line options.

A settings field declares its help text (and, where the command line should refuse a bad value
while parsing, its choices or that it is a positive integer) with :func:`setting`; its type and
default stay the dataclass's own. :class:`SettingsOptions` turns a dataclass's fields into
``--field-name`` options of one verb, with the established option names of that verb kept as
aliases, and builds the dataclass back from the parsed arguments. The defaults live only in the
dataclass: the command line shows and uses them, it never restates them.

How a field's type becomes an option: ``bool`` a flag (``--name`` when the default is False,
``--no-name`` when it is True), ``int``/``float``/``str`` (or ``... | None``) one value,
``tuple[str, ...]`` any number of values (space- or comma-separated), ``tuple[float, float]`` two
numbers. A field of another type (an object) has no option and must be excluded by the verb,
saying why.
"""
from __future__ import annotations

import argparse
import importlib
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any


def setting(default: Any = MISSING, *, help: str, choices: tuple[str, ...] | None = None,
            positive: bool = False) -> Any:
    """A dataclass field (an immutable ``default``) with its command-line help: ``choices``
    (refused while parsing, with argparse's message) and ``positive`` (an integer >= 1, refused
    while parsing) apply to the option only; the dataclass's own ``check`` stays the rule for
    Python callers."""
    return field(default=default, metadata={"help": help, "choices": choices, "positive": positive})


#: help of every ``split_seed`` (the settings that read a ShareGPT split, and the verbs without one)
SPLIT_SEED_HELP = "seed of the ShareGPT train/stats/heldout split"
#: the split seed every settings type and the CLI default to (wavesurf.data.load_corpus's own)
SPLIT_SEED_DEFAULT = 0


def split_seed_setting() -> Any:
    """The ``split_seed`` field of every settings type that reads a split (wavesurf.data.load_corpus)."""
    return setting(SPLIT_SEED_DEFAULT, help=SPLIT_SEED_HELP)


def max_len_setting() -> Any:
    """The ``max_len`` field of every settings type that captures a corpus (512 tokens by default)."""
    return setting(512, positive=True, help="truncate examples to this many tokens")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _default_of(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _shown(value: Any) -> str:
    """A default as the help shows it."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) if value else "none"
    return str(value)


def _kind(hint: Any) -> tuple[type, str]:
    """(element type, shape) of a field's type: shape is 'one', 'flag', 'many' or 'pair'."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]  # X | None
    if hint is bool:
        return bool, "flag"
    if hint in (int, float, str):
        return hint, "one"
    if typing.get_origin(hint) is tuple:
        targs = typing.get_args(hint)
        if len(targs) == 2 and targs[1] is Ellipsis and targs[0] is str:
            return str, "many"
        if len(targs) == 2 and targs[0] is targs[1] is float:
            return float, "pair"
    raise TypeError(f"{hint!r} has no command-line form")


def _comma_items(choices: tuple[str, ...] | None):
    def parse(text: str) -> list[str]:
        items = [x for x in text.replace(" ", "").split(",") if x]
        bad = [x for x in items if choices is not None and x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"invalid choice: {bad[0]!r} (choose from {', '.join(choices)})")
        return items
    return parse


@dataclass(frozen=True)
class SettingsOptions:
    """How one settings dataclass appears among one verb's options.

    ``cls``: the class, or ``"module:Class"`` imported only when the options are made (the
    settings of the heavier verbs live in modules that import torch; ``wavesurf --help`` does not);
    ``names``: field -> option name where the verb's option is not ``--field-name``; ``aliases``:
    field -> further accepted names (established spellings); ``exclude``: field -> why it has no
    option in this verb (its value comes from elsewhere); ``overrides``: field -> argparse keywords
    replacing generated ones, only for what the verb means differently (a CLI default such as None
    = "decided from another option", extra choices), with ``"shown"``: the help's words for such a
    default."""

    cls: Any
    names: Mapping[str, str] = field(default_factory=dict)
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    exclude: Mapping[str, str] = field(default_factory=dict)
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def settings_class(self) -> type:
        if isinstance(self.cls, str):
            module, _, name = self.cls.partition(":")
            return getattr(importlib.import_module(module), name)
        return self.cls

    def fields(self) -> list[Field]:
        """The fields that have an option in this verb."""
        return [f for f in fields(self.settings_class()) if f.init and f.name not in self.exclude]

    def option(self, f: Field) -> str:
        """The option's main name: ``--field-name`` (``--no-field-name`` for a flag on by default)."""
        if f.name in self.names:
            return self.names[f.name]
        prefix = "--no-" if _default_of(f) is True else "--"
        return prefix + f.name.replace("_", "-")

    def dest(self, f: Field) -> str:
        return f.name if f.name not in self.names else self.names[f.name].lstrip("-").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        cls = self.settings_class()
        hints = typing.get_type_hints(cls)
        for f in self.fields():
            meta, default = f.metadata, _default_of(f)
            if "help" not in meta:
                raise TypeError(f"{cls.__name__}.{f.name} has no help (declare it with wavesurf.settings_cli.setting)")
            elem, shape = _kind(hints[f.name])
            help_text = meta["help"]
            kw: dict[str, Any] = {"dest": self.dest(f), "default": default}
            if shape == "flag":
                kw["action"] = "store_false" if default is True else "store_true"
                if default is True:
                    help_text += " (on by default; this flag turns it off)"
            else:
                if shape == "many":
                    kw.update(nargs="*", type=_comma_items(meta.get("choices")))
                elif shape == "pair":
                    kw.update(nargs=2, type=float)
                else:
                    kw["type"] = positive_int if meta.get("positive") else elem
                    if meta.get("choices"):
                        kw["choices"] = list(meta["choices"])
            over = dict(self.overrides.get(f.name, {}))
            shown = over.pop("shown", None)  # words for an overridden default, e.g. "sharegpt@<model>"
            default = over.get("default", default)
            if shown:
                help_text += f" (default: {shown})"
            elif shape != "flag" and default is not None:
                help_text += f" (default {_shown(default)})"
            kw["help"] = help_text.replace("%", "%%")
            kw.update(over)
            parser.add_argument(self.option(f), *self.aliases.get(f.name, ()), **kw)

    def build(self, args: argparse.Namespace, **given: Any) -> Any:
        """The settings from parsed ``args``; ``given`` fields come from elsewhere (excluded or
        resolved by the verb) and win over the parsed value."""
        cls = self.settings_class()
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in self.fields():
            if f.name in given:
                continue
            value = getattr(args, self.dest(f))
            if isinstance(value, list):  # many: each value may hold several comma-separated items
                value = tuple(x for v in value for x in (v if isinstance(v, list) else [v]))
            elif _kind(hints[f.name])[1] in ("many", "pair") and value is not None:
                value = tuple(value)
            values[f.name] = value
        return cls(**values, **given)
