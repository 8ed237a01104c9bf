"""The errors that are the user's to fix: a setting, an argument, a file or a package, or a
sampler the machine lost.

Their messages name what was wrong and how to fix it; the command line prints them as one line
(``Error: ...``, exit status 1), while any other exception is a bug of this code or a library's
and keeps its traceback. They subclass the built-in error a caller would expect
(``ValueError``, ``ImportError``, ``FileNotFoundError``), so ``except ValueError`` still works.
"""


class ConfigError(ValueError):
    """A setting, argument or input that cannot work."""


class MissingDependencyError(ConfigError, ImportError):
    """An optional package that a setting needs is not installed."""


class MissingFileError(ConfigError, FileNotFoundError):
    """A file or directory a setting names does not exist or is not what it should be."""


class SamplerError(RuntimeError):
    """A sampler the run cannot do without (a Ray worker, the vLLM engine) died or hung more often
    than its restarts allow: the run stops before training on the batch it owed, its checkpoints
    intact, and ``resume=auto`` continues it."""


class DiskFullError(OSError):
    """The disk filled while the run wrote to it (a checkpoint, the metrics, the policy): the run
    stops in one line; a checkpoint's partial files are removed and the ones before it are whole,
    so ``resume=auto`` continues once there is room."""
