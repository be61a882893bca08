"""How verbs declare options: groups, help sections, renamed flags. Runs in: frontend process.

An OptionGroup's options build one dataclass that the verb takes as a single parameter,
and its title heads their section of --help. A new group is a dataclass (its fields
named as its options' parameters) plus one `OptionGroup(...)` applied as a decorator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import click
from click.core import ParameterSource

GIVEN_SOURCES = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


@dataclass(frozen=True, slots=True)
class OptionGroup:
    """Options under one --help heading; `build` makes the verb's parameter `name` out of
    their values (a ValueError from it is a usage error). As a decorator, adds them."""

    title: str
    name: str
    options: tuple[Callable, ...]
    build: Callable[..., object]

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in _params(self.options)]

    @property
    def flags(self) -> dict[str, str]:
        """Each option's flag as a user types it, by parameter name."""
        return {p.name: p.opts[0] for p in _params(self.options)}

    def __call__(self, func: Callable) -> Callable:
        names, inner = self.param_names, func

        @functools.wraps(inner)
        def func(*args, **kwargs):
            values = {n: kwargs.pop(n) for n in names}
            try:
                kwargs[self.name] = self.build(**values)
            except ValueError as e:
                raise click.UsageError(str(e)) from None
            return inner(*args, **kwargs)

        for option in reversed(self.options):
            func = option(func)
        for param in func.__click_params__[-len(self.options) :]:
            param.group_title = self.title  # read by GroupedCommand.format_options
        return func


def _params(options: tuple[Callable, ...]) -> list[click.Parameter]:
    def probe() -> None:
        return None

    for option in options:
        option(probe)
    return probe.__click_params__


def titled(title: str, *options: Callable) -> Callable:
    """Options that stay separate parameters of the verb, shown under `title` in --help."""

    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        for param in func.__click_params__[-len(options) :]:
            param.group_title = title
        return func

    return decorate


class GroupedCommand(click.Command):
    """--help with one section per option group, in the order the verb declares them."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        untitled: list[tuple[str, str]] = []  # a verb's own options, and -h
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                title = getattr(param, "group_title", None)
                (untitled if title is None else sections.setdefault(title, [])).append(record)
        for title, records in [("Options", untitled), *sections.items()]:
            with formatter.section(title):
                formatter.write_dl(records)


class KvdrainGroup(click.Group):
    command_class = GroupedCommand  # every verb's --help in sections

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # Ctrl-C before the verb took over its signals: 128 + 2, not 1
            from replay.verify.verdict import EXIT_INTERRUPTED

            click.echo("stopping (SIGINT): nothing had started", err=True)
            ctx.exit(EXIT_INTERRUPTED)


class RenamedOption(click.Option):
    """A flag's old name: hidden from --help, still taken; `replaced_by` is the parameter
    of the flag that replaces it (the verb sees the old one as that one given)."""

    def __init__(self, *args, replaced_by: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replaced_by = replaced_by


def renamed_option(old: str, new: str, replaced_by: str, **attrs) -> Callable:
    """The option `old`, renamed `new` (parameter `replaced_by`)."""
    return click.option(
        old,
        cls=RenamedOption,
        replaced_by=replaced_by,
        hidden=True,
        default=None,
        help=f"The old name of {new} (deprecated).",
        **attrs,
    )


def take_renamed(old: str, new: str, old_value: object, new_value: object) -> object:
    """The value of a renamed option: `new`'s, or `old`'s with one deprecation line on
    stderr; both given is a usage error."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise click.UsageError(f"{old}: the old name of {new}; give {new} alone")
    click.echo(f"kvdrain: {old} is deprecated, use {new} (it means the same)", err=True)
    return old_value


def is_given(name: str) -> bool:
    """Whether the running verb's option with parameter `name` was set on the command line
    (or by its environment variable), under its old name too."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    names = {name} | {p.name for p in ctx.command.params if getattr(p, "replaced_by", None) == name}
    return any(ctx.get_parameter_source(n) in GIVEN_SOURCES for n in names)


def given_options() -> frozenset[str]:
    """The parameters of the running verb set on its command line (or by their variable)."""
    ctx = click.get_current_context()
    return frozenset(
        p.name for p in ctx.command.params if not isinstance(p, RenamedOption) and is_given(p.name)
    )
