"""The one error type for mistakes a user can fix (a bad flag, a missing file), and how entry points report it:
one paragraph and exit status 2, without a traceback. Any other exception is a bug and keeps its traceback."""

import sys
from collections.abc import Callable


class UserError(Exception):
    """A problem the user can fix. The message is one paragraph that names the file or flag and the fix."""


def run_entry_point(main: Callable[[], None]) -> None:
    """Call main(); a UserError becomes `error: <message>` on stderr and exit status 2, with no traceback.

    Under torchrun each rank that meets the error prints it; the checks that raise one run on every rank (or agree
    through a collective first), so no rank is left waiting for a peer that has gone.
    """
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
