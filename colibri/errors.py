"""User-facing errors: the CLI prints these as one line and exits non-zero (no traceback)."""


class ColibriError(Exception):
    """A mistake the user can fix (bad path, unsupported tensor type, prompt too long...).

    The message says what is wrong and, where it helps, what to do instead.
    """
