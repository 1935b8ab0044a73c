"""The one exception type loracls raises for problems a user can fix."""


class LoraclsError(Exception):
    """A problem with the user's input or environment, with a message that says what to do next.

    The command line prints the message without a traceback and exits with code 2.
    """
