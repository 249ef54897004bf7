"""The one exception type the CLI turns into a one-line message and exit code 2."""


class UserError(Exception):
    """Bad input or an impossible request: the message names the problem and the fix, in one line.

    Every package derives its own errors from this (e.g. `traces.TraceFormatError`), so the CLI and the
    property tests can tell "the project refused this input" from a crash.
    """

    exit_code = 2


class NotYetImplemented(UserError):
    """A subcommand whose issue has not landed yet: it says so and exits 2 instead of pretending."""
