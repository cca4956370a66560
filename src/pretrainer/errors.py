"""Errors that end a run with one clear line instead of a traceback."""


class PretrainerError(Exception):
    """A problem with the user's input (recipe, data, paths); scripts print it and exit 2."""

    exit_code = 2
    label = "error"
    """What the line starts with (`error: ...`); empty for an outcome that is no error."""
    every_rank = True
    """False: only the first rank prints it (an outcome all ranks share)."""


class RecipeError(PretrainerError):
    """A recipe that cannot be loaded or validated. The message names the file and the field."""


class DataError(PretrainerError):
    """A data source that is missing, empty or unreadable. The message names the source."""


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first non-empty line of an exception's message (its type's name when it has none), for one-line errors."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text[:limit] if limit else text
