"""User-facing errors: the CLI prints these as one line and exits non-zero (no traceback)."""


class ColibriError(Exception):
    """A mistake the user can fix (bad path, unsupported tensor type, prompt too long...).

    The message says what is wrong and, where it helps, what to do instead.
    """


class EngineFault(Exception):
    """A fault on the serving side, not the user's request: a damaged or truncated expert file,
    non-finite logits. The server answers 5xx with this message (which names the file and the
    expert where one is to blame) and keeps serving; the CLI prints it as one line."""
