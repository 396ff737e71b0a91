"""The one error a structured-output spec raises: a 400 at the API server, naming the request field."""


class PatternError(ValueError):
    """A spec that cannot be compiled or is over a limit; the message says what and what to change."""
