"""Reading a secret (a token, a password) from a file only its owner can read.

A secret file that group or others can read is refused, as ssh refuses such a private key: the
secret may already have leaked, and using it quietly would hide that. Errors are
``FailedPrecondition`` naming the setting and the path, never the secret.
"""

from __future__ import annotations

import os

from kvstore.errors import FailedPrecondition


def read_owner_only(path: str, setting: str) -> str:
    """The whole text of a file of secrets (a secret, or ``kvstore.server.auth``'s tokens)."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise FailedPrecondition(f"{setting} {path}: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise FailedPrecondition(
            f"{setting} {path} is readable by group or others (mode {mode & 0o777:o}); "
            "the secret in it may have leaked and is not used: chmod 600 it"
        )
    return text


def read_secret_file(path: str, setting: str) -> str:
    """The file's text without surrounding white space (one line: the secret)."""
    text = read_owner_only(path, setting).strip()
    if not text:
        raise FailedPrecondition(f"{setting} {path} is empty")
    return text
