"""Why a JSON or TOML text that someone else wrote could not be parsed, in a few words for an error message.

json.loads and tomllib raise more than their own decode errors on bad input: bytes that are not UTF-8 raise a
UnicodeDecodeError, a value nested thousands of levels deep a RecursionError, and a number of over 4,300 digits a
ValueError from Python's limit on parsing integers, whose message advises sys.set_int_max_str_digits(). Readers
catch PARSE_ERRORS and put parse_problem(e) in their own message, which names the file and the fix.
"""

import json

import tomllib

# What json.loads(text or bytes) and tomllib.load(s) raise on bad input: JSONDecodeError, TOMLDecodeError and
# UnicodeDecodeError are ValueErrors too.
PARSE_ERRORS = (ValueError, RecursionError)


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
