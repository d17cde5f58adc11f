"""Errors that verispec reports to users as clear messages rather than tracebacks."""


class VerispecError(Exception):
    """Base class: the CLI prints these as `error: ...` and exits with status 2."""


class ModelNotFoundError(VerispecError, FileNotFoundError):
    pass


class IncompatibleDraftError(VerispecError, ValueError):
    pass
