"""Report unknown flags before missing required ones.

argparse checks required arguments (a required subcommand, ``--spec``, ``--model-path``) before it reports
unrecognized ones, so ``cmd --bogus`` says "the following arguments are required: ..." and never names
``--bogus``. ``parse_args`` first parses with every ``required`` switched off (also inside subcommands) and,
when anything is left over, calls ``parser.error("unrecognized arguments: ...")`` (argparse's own wording,
exit status 2 unless the parser's ``error`` is overridden); otherwise it parses normally.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence


def _actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that unknown flags are reported first, naming them."""
    actions = list(_actions(parser))
    required = [action.required for action in actions]
    for action in actions:
        action.required = False
    try:
        _, unknown = parser.parse_known_args(argv)
    finally:
        for action, was in zip(actions, required, strict=True):
            action.required = was
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return parser.parse_args(argv)
