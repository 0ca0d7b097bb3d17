"""Run a channel's inbox workers alone: ``python -m chatflow_sqlalchemy.channels MODULE:NAME``.

For deployments that keep the workers apart from the web processes (which
serve ``channel.app`` built with ``in_app_workers=False``). ``MODULE:NAME``
names a :class:`~chatflow_sqlalchemy.channels.DurableWhatsAppChannel` with its
runner attached, or a function without arguments that returns one, as
uvicorn names an app; the current directory is importable. The workers run
until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["load_channel", "main"]


def load_channel(target: str) -> Any:
    """The channel ``MODULE:NAME`` names (calling ``NAME`` if it is a factory).

    Raises:
        ValueError: ``target`` is not ``MODULE:NAME`` or names no channel.

    """
    from chatflow_sqlalchemy.channels import DurableWhatsAppChannel

    module_name, _, name = target.partition(":")
    if not module_name or not name:
        raise ValueError(f"expected MODULE:NAME (e.g. myapp:channel), got {target!r}")
    found: Any = importlib.import_module(module_name)
    for part in name.split("."):
        found = getattr(found, part)
    if not isinstance(found, DurableWhatsAppChannel) and callable(found):
        found = found()
    if not isinstance(found, DurableWhatsAppChannel):
        raise ValueError(
            f"{target} is a {type(found).__name__}, not a DurableWhatsAppChannel "
            "(or a function returning one)"
        )
    return found


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, load the channel and run its workers until signalled."""
    parser = argparse.ArgumentParser(
        prog="python -m chatflow_sqlalchemy.channels",
        description="Run the inbox workers of a DurableWhatsAppChannel until SIGINT/SIGTERM.",
    )
    parser.add_argument("target", metavar="MODULE:NAME",
                        help="the channel (or a function returning it), e.g. myapp:channel")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        channel = load_channel(args.target)
    except (ImportError, AttributeError, ValueError) as exc:
        parser.error(str(exc))
    channel.run_workers()


if __name__ == "__main__":
    main()
