"""OpenAI's error object: what the server answers a request it refuses or cannot serve."""

from ..validate import Problem


class RequestError(Exception):
    """A request the server refuses: becomes an HTTP response with OpenAI's error object."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    @property
    def type(self) -> str:
        return {
            400: "invalid_request_error",
            404: "invalid_request_error",
            408: "invalid_request_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
        }.get(self.status, "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def of(cls, problem: Problem) -> "RequestError":
        return cls(problem.message, problem.param, code=problem.code)
