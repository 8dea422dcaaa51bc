"""User-facing errors: one line that names the culprit and the fix, never a traceback."""


class UserError(Exception):
    """Bad input from the user (config, data file, client message).

    The CLI prints ``str(error)`` on one line and exits with status 2.
    """

    exit_code = 2
