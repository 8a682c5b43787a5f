"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from typing import Optional


class ApiError(Exception):
    """An error the client gets as JSON with ``status``; raise it anywhere in a handler."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers
        self.recorded = False  # counted in the server's metrics already (an engine abort's error)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", None, "engine_not_alive")


# Seconds a client told the queue is full waits before it tries again (the official clients honour it).
QUEUE_FULL_RETRY_AFTER_S = 1


def queue_full(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", None, "queue_full",
                    headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)})
