"""User-facing errors: one line that names the culprit and the fix, never a traceback."""


class UserError(Exception):
    """Bad input from the user (config, data file, client message).

    The CLI prints ``str(error)`` on one line and exits with status 2.
    """

    exit_code = 2


class RunStopped(UserError):
    """A run that stopped cleanly before its last round (a round could not complete): the CLI prints one
    line and exits with status 3, distinct from bad input; the run resumes from its last checkpoint."""

    exit_code = 3
