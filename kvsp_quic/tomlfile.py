"""Reading a TOML file for a user (configuration, policy): one-line errors that name the file."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from typing import Any


def read_toml(path: str | os.PathLike[str], where: str, error: Callable[[str], Exception]) -> dict[str, Any]:
    """The table in the file at *path*; *error* (called with a one-line message that starts with *where*, e.g.
    ``"config 'x.toml'"``) makes the exception raised when the file cannot be read or is not TOML."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise error(f"cannot read {where}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{where}: not valid TOML ({exc})") from None


__all__ = ["read_toml"]
