"""Command line: ``python -m hybridsp <command> [options]``.

Each command is a module with ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> exit status``; add one by adding a line to :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

COMMANDS = {  # name -> module implementing it
    "plan": "hybridsp.planner._cli",
    "check-mesh": "hybridsp._commands.check_mesh",
    "check-model": "hybridsp.integrations.transformers._check_model",
    "verify": "hybridsp._commands.verify",
}


def plain_text(docstring: str | None) -> str:
    """A docstring as a terminal shows it: ``literal`` -> literal, :role:`name` -> name."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", docstring or "")
    return text.replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command."""
    parser = argparse.ArgumentParser(prog="python -m hybridsp", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(
            name,
            help=module.HELP,
            description=plain_text(module.__doc__),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
