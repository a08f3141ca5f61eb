"""Report unknown flags before missing required ones.

argparse checks required arguments (a required subcommand, ``--spec``, ``--model-path``) before it reports
unrecognized ones, so ``cmd --bogus`` says "the following arguments are required: ..." and never names
``--bogus``. ``parse_args`` first parses with every ``required`` switched off (also inside subcommands) and,
when anything is left over, calls ``error("unrecognized arguments: ...")`` (argparse's own wording, exit
status 2 unless the parser's ``error`` is overridden) of the subcommand's parser when one was given
(``kvfleet-agent run: error: ...`` under ``run``'s usage), else of ``parser``; otherwise it parses
normally. The usage line of each parser is fixed before that first pass, so ``--help`` (and the error's
usage) still shows a required flag as required (``--spec SPEC``, not ``[--spec SPEC]``).

Each unknown flag is explained: ``explain(flag)`` (a caller's hook, e.g. upstream flags KVFleet leaves out)
when it answers, else the closest real flags of that parser by ``difflib`` ("did you mean ...?").
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Iterator, Sequence

MAX_SUGGESTIONS = 3


def own_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """``parser``'s own actions in the order they were added (flags, positionals, its subcommands' action),
    not its subcommands'. argparse has no public read of them: this module is the one reader of its list."""
    return list(parser._actions)


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """``parser``'s own flags (actions with option strings), ``--help`` left out."""
    return [a for a in own_actions(parser) if a.option_strings and a.dest != "help"]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``parser``'s subcommands: name -> parser ({} when it has none)."""
    return {
        name: sub
        for action in own_actions(parser)
        if _is_subcommands(action)
        for name, sub in action.choices.items()
    }


def _is_subcommands(action: argparse.Action) -> bool:
    return isinstance(action, argparse._SubParsersAction)


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in own_actions(parser):
        if _is_subcommands(action):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in own_actions(parser):
        yield action
        if _is_subcommands(action):
            for sub in action.choices.values():
                yield from _actions(sub)


def closest_flags(flag: str, known: dict[str, str]) -> list[str]:
    """Up to ``MAX_SUGGESTIONS`` flags closest to ``flag``, best first. ``known`` maps every option string
    to the one a suggestion names (an alias's canonical flag); names are compared without the dashes and
    with ``_`` read as ``-``, so ``--model_path`` finds ``--model-path``."""

    def name(option: str) -> str:
        return option.lstrip("-").replace("_", "-")

    by_name = {name(option): canonical for option, canonical in known.items()}
    matches = difflib.get_close_matches(name(flag), list(by_name), n=len(by_name), cutoff=0.6)
    return list(dict.fromkeys(by_name[match] for match in matches))[:MAX_SUGGESTIONS]


def describe_unknown(
    unknown: Sequence[str], known: dict[str, str], explain: Callable[[str], str | None] | None = None
) -> str:
    """The error for the leftover ``unknown`` argv items: each flag's ``explain`` answer (its values
    dropped), else "unrecognized arguments: ..." naming the closest ``known`` flags (see
    :func:`closest_flags`) after the flag and its values (``--hicache-ratoi 2 (did you mean
    --hicache-ratio?)``); items that follow no unknown flag (a stray value) are listed as they are."""
    parts: list[str] = []
    plain: list[list[str]] = []  # [flag and its values, hint]
    explained = False
    for item in unknown:
        if not item.startswith("-"):
            if explained:
                continue
            if plain and plain[-1][1]:
                plain[-1][0] += f" {item}"
            else:
                plain.append([item, ""])
            continue
        flag = item.split("=", 1)[0]
        why = explain(flag) if explain else None
        explained = why is not None
        if why is not None:
            parts.append(why)
            continue
        close = closest_flags(flag, known)
        plain.append([item, f" (did you mean {' or '.join(close)}?)" if close else ""])
    if plain:
        parts.insert(0, "unrecognized arguments: " + " ".join(text + hint for text, hint in plain))
    return "; ".join(parts)


def _option_strings(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every option string of ``parser`` (and its subcommands) -> the action's first long one."""
    out = {}
    for action in _actions(parser):
        longs = [o for o in action.option_strings if o.startswith("--")] or action.option_strings
        for option in action.option_strings:
            out.setdefault(option, longs[0])
    return out


def _chosen_parser(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> argparse.ArgumentParser:
    """The subcommand's parser ``namespace`` was parsed into (the innermost one, through nested
    subcommands), else ``parser``: its usage and its ``prog`` (``kvfleet-agent run``) head the error, and
    only its flags are suggested."""
    for action in own_actions(parser):
        if _is_subcommands(action) and action.dest != argparse.SUPPRESS:
            sub = action.choices.get(getattr(namespace, action.dest, None))
            if sub is not None:
                return _chosen_parser(sub, namespace)
    return parser


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    explain: Callable[[str], str | None] | None = None,
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that unknown flags are reported first, naming them, each with
    ``explain(flag)`` or the closest real flags (:func:`describe_unknown`)."""
    parsers = [p for p in _parsers(parser) if p.usage is None]
    for p in parsers:  # argparse formats usage from ``required`` when it prints it: freeze it first
        p.usage = p.format_usage().removeprefix("usage: ").rstrip("\n").replace("%", "%%")
    actions = list(_actions(parser))
    required = [action.required for action in actions]
    for action in actions:
        action.required = False
    try:
        namespace, unknown = parser.parse_known_args(argv)
    finally:
        for action, was in zip(actions, required, strict=True):
            action.required = was
        for p in parsers:
            p.usage = None
    if unknown:
        chosen = _chosen_parser(parser, namespace)
        chosen.error(describe_unknown(unknown, _option_strings(chosen), explain))
    return parser.parse_args(argv)
