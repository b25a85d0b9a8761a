"""One exception hierarchy: the CLI prints a RunnerError as one line and exits non-zero.

Anything else is a bug and keeps its traceback.
"""

import errno


class RunnerError(Exception):
    """A problem the user can fix; the message is one line with a hint."""

    exit_code = 1


class ConfigError(RunnerError):
    """The config file is invalid (all problems are reported at once)."""

    exit_code = 2

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class InputError(RunnerError):
    """A command-line argument names nothing usable (no such run, a prefix of several runs, a special file)."""

    exit_code = 2


class SubmitError(RunnerError):
    """The scheduler refused or failed a submission."""


class BuildError(RunnerError):
    """An image build step failed or no builder is available."""


class ClusterError(RunnerError):
    """The local development cluster could not be started or reached."""


class PreflightError(RunnerError):
    """A preflight check failed before training."""


FILESYSTEM_SAYS_NO = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)


def refused_by_filesystem(e: OSError) -> InputError | None:
    """The file system's refusal (read-only, not this user's, full) as the user's to fix, in one line (exit 2); None
    for any other OSError, which is a bug and keeps its traceback. The CLI prints it; the Python API raises it."""
    if e.errno not in FILESYSTEM_SAYS_NO:
        return None
    return InputError(f"{e.filename or 'a file'}: cannot write it: {(e.strerror or '').lower()}; expected a path this "
                      "user can write. hint: check its owner and mode, the mount, and the free space")
