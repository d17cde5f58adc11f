"""Errors that verispec reports to users as clear messages rather than tracebacks."""


class VerispecError(Exception):
    """Base class: the CLI prints these as `error: ...` and exits with status 2."""


class ModelNotFoundError(VerispecError, FileNotFoundError):
    pass


class IncompatibleDraftError(VerispecError, ValueError):
    pass


class PromptTooLongError(VerispecError, ValueError):
    """A prompt that leaves no room in the model's context (`tokens` long)."""

    def __init__(self, tokens: int, context: int) -> None:
        super().__init__(f"prompt of {tokens} tokens leaves no room in the model's context of "
                         f"{context}")
        self.tokens, self.context = tokens, context
