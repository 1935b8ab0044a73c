"""The exception types loracls raises for problems a user can fix, and for a stop a user asked for."""


class LoraclsError(Exception):
    """A problem with the user's input or environment, with a message that says what to do next.

    The command line prints the message without a traceback and exits with code 2.
    """


class Interrupted(LoraclsError):
    """A command stopped on SIGINT/SIGTERM; the message says where and what was kept (training: after
    writing a checkpoint). The command line exits with 130, as a shell does for Ctrl-C."""

    exit_code = 130
