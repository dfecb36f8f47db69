"""Command-line plumbing shared by every jfp8kv command.

Flags: every field of ``LoadConfig``, ``CacheOptions`` and ``EngineConfig`` is one flag,
``--field-name`` (vLLM's names), with the help, choices and value parser from the field's
metadata in ``jfp8kv.config``; a knob added there appears in ``generate``, ``serve`` and
``LLM`` at once. Start-up: logging with JAX's backend probe kept quiet, and errors a user
causes while the engine is built (a missing model path, an option that does not fit) shown
as one line with exit code 2, as argparse does for a bad flag; a bad flag itself is one line
too (``ArgumentParser``), not argparse's whole usage text.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import typing
from typing import Iterator, NoReturn

from jfp8kv.config import OPTION_CLASSES, CacheOptions, EngineConfig, LoadConfig

log = logging.getLogger(__name__)

_GROUP_TITLES = {LoadConfig: "model", CacheOptions: "KV cache", EngineConfig: "engine"}
# Loggers whose start-up chatter is noise to a user (JAX probing for TPU/GPU plugins).
_NOISY_LOGGERS = ("jax._src.xla_bridge",)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: ``PROG: error: MESSAGE`` and exit code 2,
    without the usage block (dozens of lines for the engine's flags) that would push the
    message off the screen. argparse's messages name what would work (an invalid choice
    lists the choices); ``--help`` still prints the full usage."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message} (--help lists the flags)")


def check_port(p: argparse.ArgumentParser, port: int) -> None:
    """A TCP port the server can listen on (0 picks a free one), checked with the other
    flags, before anything loads."""
    if not 0 <= port <= 65535:
        p.error(f"argument --port: {port} is not a TCP port (0-65535)")


def flag_name(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def _value_parser(cls, field: dataclasses.Field):
    if field.metadata.get("parse"):
        return field.metadata["parse"]
    hint = typing.get_type_hints(cls)[field.name]
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return kinds[0] if kinds[0] in (int, float, str) else str


def add_config_args(p: argparse.ArgumentParser, *classes, defaults: dict | None = None,
                    notes: dict | None = None):
    """Add one flag per field of each config class (one argument group per class).
    ``defaults`` overrides a field's default for this command only; ``notes`` adds a word
    after such a default in the help (e.g. how it differs from the other commands')."""
    defaults, notes = defaults or {}, notes or {}
    for cls in classes:
        group = p.add_argument_group(_GROUP_TITLES.get(cls, cls.__name__))
        for f in dataclasses.fields(cls):
            default = defaults.get(f.name, f.default)
            help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse formats it
            if f.name in defaults:  # this command's own default replaces the field's
                help_text = help_text.split(" (default")[0]
            if f.name in notes:
                help_text += " (default: %(default)s; " + notes[f.name].replace("%", "%%") + ")"
            if default is not None and "(default" not in help_text:
                help_text += " (default: %(default)s)"
            if isinstance(f.default, bool):  # --name / --no-name
                group.add_argument(flag_name(f), dest=f.name, default=default,
                                   action=argparse.BooleanOptionalAction, help=help_text)
                continue
            group.add_argument(flag_name(f), dest=f.name, default=default,
                               type=_value_parser(cls, f), choices=f.metadata.get("choices"),
                               metavar=f.metadata.get("metavar"), help=help_text)
    return p


def add_engine_args(p: argparse.ArgumentParser, defaults: dict | None = None,
                    notes: dict | None = None):
    """The flags of ``LLM``: model, KV cache and engine options."""
    return add_config_args(p, *OPTION_CLASSES, defaults=defaults, notes=notes)


def configs_from_args(args: argparse.Namespace):
    """``(LoadConfig, CacheOptions, EngineConfig)`` from parsed flags (ValueError if a value
    does not fit, e.g. --page-size 12)."""
    return tuple(cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
                 for cls in OPTION_CLASSES)


def llm_kwargs(args: argparse.Namespace) -> dict:
    """Flat ``LLM(**kwargs)`` from parsed flags."""
    return {f.name: getattr(args, f.name) for cls in OPTION_CLASSES
            for f in dataclasses.fields(cls)}


def build_llm(args: argparse.Namespace, prog: str):
    """The ``LLM`` the flags describe, not warmed up (the server warms it up as its
    ``--warmup`` says; ``generate`` compiles what its prompts use); user errors end the
    process (see ``user_errors``)."""
    with user_errors(prog):
        load, cache, engine = configs_from_args(args)
        from jfp8kv.engine.llm import LLM

        return LLM(load.model, load.dtype, cache_options=cache, engine_config=engine,
                   warmup=False)


def setup_logging(level: str | int = "INFO",
                  fmt: str = "%(levelname)s %(name)s: %(message)s") -> None:
    """Configure the root logger and keep JAX's backend-probe lines (e.g. "Unable to
    initialize backend 'tpu'") out of a user's terminal unless debugging."""
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, format=fmt)
    quiet = max(logging.WARNING, logging.getLogger().getEffectiveLevel())
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        quiet = logging.DEBUG
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(quiet)


def fail(prog: str, message: str) -> NoReturn:
    """One line on stderr and exit code 2 (argparse's convention for usage errors)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


@contextlib.contextmanager
def user_errors(prog: str) -> Iterator[None]:
    """Turn a missing or unreadable file (model, scales JSON) or a rejected option into
    ``fail``; the traceback is logged at DEBUG level for whoever needs it."""
    try:
        yield
    except (OSError, ValueError) as e:  # OSError: missing or unreadable files
        log.debug("start-up failed", exc_info=True)
        fail(prog, str(e))
