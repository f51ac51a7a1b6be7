"""`tinyrt` command line: one module per command, each with `add_parser` and `main`."""

from __future__ import annotations

import argparse
import sys

from tinyrt.errors import TinyrtError, printable

from . import bench, chat, convert, generate, info, listing, ppl, pull, rm, run, serve

COMMANDS = {"run": run, "pull": pull, "convert": convert, "generate": generate, "chat": chat,
            "ppl": ppl, "bench": bench, "info": info, "serve": serve, "list": listing, "rm": rm}


class Parser(argparse.ArgumentParser):
    """argparse's parser with its errors in one line, as every error of tinyrt (not the usage
    first), a misspelled option or command named first with the closest one; the commands'
    parsers are of this class too (add_subparsers makes its own kind), and take their
    positionals among their options (`generate MODEL --temperature 0 PROMPT`)."""

    _commands = None          # the top parser's subparsers action (None: a command's parser)
    _given: list = []         # the arguments being parsed, for `error`
    _intermixing = False

    def add_subparsers(self, **kwargs):
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixing:     # (parse_known_intermixed_args's own two passes)
            return super().parse_known_args(args, namespace)
        self._given = sys.argv[1:] if args is None else list(args)
        if self._commands is not None:
            return super().parse_known_args(self._given, namespace)
        # a command's parser. argparse's plain parse of `generate MODEL --temperature 0 PROMPT`
        # takes MODEL as PROMPT (an optional positional before a required one matches nothing
        # when options follow) and leaves PROMPT over; the intermixed parse takes every
        # positional wherever it is, but loses "--" (3.10 to 3.13). So what follows "--" (every
        # argument positional, as POSIX has it: `run MODEL -- -PROMPT`) is parsed as stand-ins
        # no option can look like (an argument cannot hold a NUL), then given back.
        given, after = self._given, []
        if "--" in given:
            cut = given.index("--")
            given, after = given[:cut], given[cut + 1:]
        stand_ins = {f"\0{i}": arg for i, arg in enumerate(after)}
        self._intermixing = True
        try:
            namespace, extras = self.parse_known_intermixed_args([*given, *stand_ins],
                                                                 namespace)
        finally:
            self._intermixing = False
        for name, value in vars(namespace).items():
            if isinstance(value, str) and value in stand_ins:
                setattr(namespace, name, stand_ins[value])
            elif isinstance(value, list):
                setattr(namespace, name, [stand_ins.get(v, v) if isinstance(v, str) else v
                                          for v in value])
        extras = [stand_ins.get(v, v) for v in extras]
        if extras:                # (nothing after a command's parser could take them)
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str):
        # what argparse reports is what it met first; an option or command misspelled is more
        # often the cause (its value then taken as PROMPT, a required option missing): said first
        message, see = self._misspelled() or (" ".join(message.split()), True)
        self.exit(2, printable(f"tinyrt: error: {message}")
                  + (f" (see {self.prog} --help)" if see else "") + "\n")

    def _misspelled(self) -> tuple[str, bool] | None:
        """The first option (or, on the top parser, command) given that this parser does not
        know: its message, and whether to point to --help (not where it names the likely one)."""
        from tinyrt.errors import closest

        known = self._option_string_actions
        for arg in self._given:
            if arg == "--":                         # (what follows is positional)
                return None
            if not arg.startswith("-") or arg == "-":
                if self._commands is None:
                    continue
                if arg in self._commands.choices:     # the command's own parser checks the rest
                    return None
                close = closest(arg, self._commands.choices)
                return (f"unknown command {arg}" + (f" (did you mean {close}?)" if close else ""),
                        not close)
            name = arg.split("=", 1)[0]
            # (argparse takes negative numbers and text with spaces as values, an option's
            # unique prefix as the option, and -n5 as -n 5; an ambiguous prefix it reports)
            if self._negative_number_matcher.match(arg) or " " in arg or name in known:
                continue
            if name.startswith("--") and any(k.startswith(name) for k in known) or \
                    not name.startswith("--") and arg[:2] in known:
                continue
            close = closest(name, known)
            if close:
                return f"unknown option {name} (did you mean {close}?)", False
            if self._commands is not None and any(
                    name in p._option_string_actions for p in self._commands.choices.values()):
                return f"unknown option {name} (options go after the command: tinyrt COMMAND " \
                       f"{name} ...)", False
            return f"unknown option {name}", True
        return None


def build_parser() -> argparse.ArgumentParser:
    from tinyrt import __version__

    parser = Parser(prog="tinyrt", description="Edge / on-device LLM chat runtime.")
    parser.add_argument("--version", action="version", version=f"tinyrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        module.add_parser(sub)
    return parser


def short_help(parser: Parser) -> str:
    """The usage line and the commands, each with its line of help: what a bare `tinyrt` says."""
    commands = parser._commands._choices_actions
    width = max(len(c.dest) for c in commands)
    return (parser.format_usage() + "\ncommands:\n"
            + "".join(f"  {c.dest:<{width}}  {c.help}\n" for c in commands)
            + "\ntinyrt COMMAND --help: a command's options\n")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        # no command: the short help instead of argparse's error, on stderr with argparse's
        # exit code 2, as every other command line that runs nothing (a script's empty
        # $COMMAND fails, and its captured stdout holds no help text)
        sys.stderr.write(short_help(parser))
        return 2
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command].main(args) or 0
    except TinyrtError as e:
        # (its text may hold a model's or a file's: a name, a field, a token)
        print(printable(f"tinyrt: error: {e}"), file=sys.stderr)
        return 1
    except MemoryError:      # (an allocation no check saw coming: loading guards its own)
        print("tinyrt: error: out of memory: a smaller --kv-size (-c), a smaller model or a "
              "shorter prompt", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into a program that stopped reading
        sys.stderr.close()
        return 0
