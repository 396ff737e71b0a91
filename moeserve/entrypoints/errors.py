"""The error every HTTP answer of moeserve's servers carries: OpenAI's error body, raised where the problem is
found (a route, a handler, the request models, the ASGI guard) and answered by the app's one handler."""
from __future__ import annotations

from pydantic import ValidationError


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers  # e.g. Retry-After on a 503 of SLO-aware admission

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "BadRequestError"),
                          "param": self.param, "code": self.code or self.status}}


def validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, as one readable line naming the field."""
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"] if not _is_union_tag(str(x))]
    if err["type"] == "json_invalid":
        return APIError(f"the request body is not valid JSON: {err['msg']}", code="invalid_json")
    if not loc:
        return APIError(f"the request body must be a JSON object: {err['msg']}")
    field = ".".join(loc)
    return APIError(f"invalid value for '{field}': {err['msg']}", param=field.split(".")[0])


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "TextPart"}


def _is_union_tag(x: str) -> bool:
    """pydantic names the union member that failed in `loc` ("str", "list[int]", ...); fields are not those."""
    return x in _TYPE_TAGS or "[" in x
