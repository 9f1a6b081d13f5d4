"""What the engine raises at a request it cannot serve as asked."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (empty prompt, too long, bad token ids).
    `param`: the request field at fault, when it is not the prompt; `code`: OpenAI's error
    code for it, when it has one."""

    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt + output tokens do not fit the context window (`context_window.check_context`)."""

    code = "context_length_exceeded"


class EngineStepError(RuntimeError):
    """Steps kept failing with nobody's request to blame: the engine itself is broken (a
    device fault, a bug). Raised out of `EngineCore.step`; the loop that runs it dies."""
