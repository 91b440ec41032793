"""What the parsers of ``python -m bench``'s commands share: the name, the whole module docstring as the
description, and help that ends with each option's default."""

from __future__ import annotations

import argparse
import getpass
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path


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


def keyed_compile_cache() -> str:
    """Point torch.compile's on-disk caches (Inductor's and AOTAutograd's, under ``TORCHINDUCTOR_CACHE_DIR``) at a
    directory of this tree of hkernels, unless the variable is set: those caches key a compiled graph by what
    dynamo traced, where an hkernels op is one node, so a graph compiled with another tree's kernels or host code
    (an edit, an upgrade) would be found and run as it was. The directory is named by a hash of hkernels' and
    triton_fallback's sources and tables; the same tree finds its own compiled graphs again. Returns the
    directory in use."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return os.environ["TORCHINDUCTOR_CACHE_DIR"]
    digest = hashlib.sha256()
    for package in ("hkernels", "triton_fallback"):
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            for path in sorted(Path(root).rglob("*")):
                if path.suffix in (".py", ".json") and path.is_file():
                    digest.update(str(path.relative_to(root)).encode())
                    digest.update(path.read_bytes())
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # (no user name where the process runs)
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    where = str(Path(tempfile.gettempdir()) / f"torchinductor_{user}" / f"hkernels-{digest.hexdigest()[:16]}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
    return where
