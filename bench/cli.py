"""What the parsers of ``python -m bench``'s commands share: the name, the whole module docstring as the
description, and help that ends with each option's default."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Prints the description as written; appends its default to each option's help (unless the help states it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.required:
            return f"{text} (required)"
        if action.nargs == 0:  # a flag
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


def parser(command: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m bench <command>``, described by ``doc`` (its module's docstring)."""
    return argparse.ArgumentParser(prog=f"python -m bench {command}", description=(doc or "").replace("``", ""),
                                   formatter_class=HelpFormatter)
