"""Why a JSON or TOML text could not be parsed, in a few words for an error message. Readers catch PARSE_ERRORS: json
and tomllib raise more than their decode errors (UnicodeDecodeError, RecursionError, ValueError: over 4,300 digits)."""

import json

import tomllib

PARSE_ERRORS = (ValueError, RecursionError)  # (JSONDecodeError, TOMLDecodeError, UnicodeDecodeError: ValueErrors)


def parse_problem(error: ValueError | RecursionError) -> str:
    """What is wrong with the text, e.g. "not valid JSON (column 9: Expecting value)"."""
    if isinstance(error, json.JSONDecodeError):
        where = f"column {error.colno}" if error.lineno == 1 else f"line {error.lineno}, column {error.colno}"
        return f"not valid JSON ({where}: {error.msg})"
    if isinstance(error, tomllib.TOMLDecodeError):
        return f"not valid TOML ({error})"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start:,})"
    if isinstance(error, RecursionError):
        return "nested too deeply to be read"
    return f"not readable ({str(error).split(';')[0]})"  # Python's limit on the digits of an integer
