"""The one exception type for mistakes a user can fix; the CLI prints it as one `error:` line."""


class UserError(Exception):
    """Bad input (path, file, option): reported as `error: <message>`, exit status 2."""
