"""What the ``collsvc`` subcommands share: exit codes, the default coordinator, usage errors, tokens.

The command modules (``main``, ``remote``, ``observe``) import this one, never each other
upward.
"""

from __future__ import annotations

import os

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
DEFAULT_COORDINATOR = "127.0.0.1:29400"


class UsageError(Exception):
    """A usage problem found after parsing (printed as one line, exit code 2)."""


def read_token_file(path: str | None) -> str | None:
    """The stripped contents of ``path``, else the token from the environment (``collsvc.config``).

    Raises:
        UsageError: the file cannot be read or is empty.
    """
    from collsvc import config

    if path is None:
        try:
            return config.read_token(None, os.environ)
        except OSError as exc:
            raise UsageError(f"cannot read $COLLSVC_TOKEN_FILE: {exc}") from exc
    try:
        with open(path, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise UsageError(f"cannot read token file {path}: {exc.strerror or exc}") from exc
    if not token:
        raise UsageError(f"token file {path} is empty")
    return token
