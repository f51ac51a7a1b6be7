"""`tinyrt run [MODEL] [PROMPT]`: ollama's first command. With a PROMPT it answers once
(`generate`), without one it opens the chat (`chat`); it takes the options of both, as they
define them."""

from __future__ import annotations

import argparse

from tinyrt.errors import TinyrtError

from . import chat, generate


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="chat with a model, or answer one PROMPT (as ollama run)",
                       description="With PROMPT (or -p PROMPT; '-' reads it from stdin): stream "
                                   "one reply, as `tinyrt generate`. Without: chat, as `tinyrt "
                                   "chat`. MODEL as every command takes it (default: the default "
                                   "model); a lone argument is MODEL, as in `ollama run MODEL`.")
    generate.add_prompt_arguments(p)
    for command in (generate, chat):
        _add_options_of(p, command)


def _add_options_of(p: argparse.ArgumentParser, command) -> None:
    """The options of `command`'s parser that `p` lacks, the same actions in groups of the same
    titles (one definition of each: an option either command gains, run takes too)."""
    scratch = argparse.ArgumentParser().add_subparsers()
    command.add_parser(scratch)
    (theirs,) = scratch.choices.values()
    groups = {g.title: g for g in p._action_groups}
    for group in theirs._action_groups:
        for action in group._group_actions:
            if not action.option_strings or any(s in p._option_string_actions
                                                for s in action.option_strings):
                continue              # (the positionals, -h, and the options both commands share)
            if group.title not in groups:
                groups[group.title] = p.add_argument_group(group.title, group.description)
            groups[group.title]._add_action(action)
    # defaults set by set_defaults, not by an action (the cache options' kv_size_default)
    p.set_defaults(**{k: v for k, v in theirs._defaults.items() if k not in p._defaults})


# the options that only shape a single reply's output, which the chat does not take
REPLY_ONLY = (("--raw", "raw"), ("--stats", "stats"), ("--json", "json"))


def main(args: argparse.Namespace) -> int:
    generate.place_prompt(args, lone="model")
    if args.prompt is not None:
        return generate.answer(args)
    for flag, dest in REPLY_ONLY:
        if getattr(args, dest):
            raise TinyrtError(f"{flag} is for one reply: give a PROMPT (tinyrt run MODEL PROMPT "
                              f"{flag}), or leave {flag} out to chat")
    return chat.main(args)
