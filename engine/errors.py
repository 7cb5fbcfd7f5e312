"""Errors caused by user input: the CLIs print them without a traceback (exit 2),
the server turns them into OpenAI-style 4xx bodies."""


class EngineError(Exception):
    """Base class for errors whose message is meant for the user."""


class UnknownModelError(EngineError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ModelSourceError(EngineError, ValueError):
    pass


class ModelLoadError(EngineError, RuntimeError):
    pass


class UnsupportedModelError(EngineError, ValueError):
    pass


class InvalidSamplingError(EngineError, ValueError):
    pass


class DraftMismatchError(EngineError, ValueError):
    """A draft model whose tokenizer is not the target's (its drafts would be other tokens)."""


USER_ERRORS = (EngineError,)


class RequestTooLarge(EngineError, ValueError):
    """A request whose projected KV bytes exceed the whole budget (the server answers 400)."""
