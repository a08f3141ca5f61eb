"""Report unknown flags before missing required ones.

argparse checks required arguments (a required subcommand, ``--spec``, ``--model-path``) before it reports
unrecognized ones, so ``cmd --bogus`` says "the following arguments are required: ..." and never names
``--bogus``. ``parse_args`` first parses with every ``required`` switched off (also inside subcommands) and,
when anything is left over, calls ``parser.error("unrecognized arguments: ...")`` (argparse's own wording,
exit status 2 unless the parser's ``error`` is overridden); otherwise it parses normally. The usage line
of each parser is fixed before that first pass, so ``--help`` (and the error's usage) still shows a required
flag as required (``--spec SPEC``, not ``[--spec SPEC]``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that unknown flags are reported first, naming them."""
    parsers = [p for p in _parsers(parser) if p.usage is None]
    for p in parsers:  # argparse formats usage from ``required`` when it prints it: freeze it first
        p.usage = p.format_usage().removeprefix("usage: ").rstrip("\n").replace("%", "%%")
    actions = list(_actions(parser))
    required = [action.required for action in actions]
    for action in actions:
        action.required = False
    try:
        _, unknown = parser.parse_known_args(argv)
    finally:
        for action, was in zip(actions, required, strict=True):
            action.required = was
        for p in parsers:
            p.usage = None
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return parser.parse_args(argv)
