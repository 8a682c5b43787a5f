"""A cap on a request body's bytes, as a plain ASGI wrapper around the app.

FastAPI reads a JSON body whole and parses it before any handler runs, so a client can make the server hold a
body of any size several times over (its bytes, the parsed objects, pydantic's copy): a few hundred megabytes
were enough for the host to kill the process, and every request with it. A body over the limit is answered 413
in OpenAI's error shape; what a legitimate request can carry (128 choices of prompts that fit the context, tool
definitions) stays far below the default.

Plain ASGI, not Starlette's BaseHTTPMiddleware, which would hide a client's disconnect from the handlers.
"""
from __future__ import annotations

import json

DEFAULT_MAX_REQUEST_BYTES = 32 << 20


class BodyLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive int, got {max_bytes!r}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        # The HTTP parser holds the body to its declared length, unless it is sent in chunks: a client declaring
        # both gets its chunks read whole (uvicorn's parser takes them), so then the bytes are counted below.
        if declared is not None and b"transfer-encoding" not in headers:
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._refuse(send, f"{int(declared)} bytes")
            return await self.app(scope, receive, send)
        # A body sent in chunks, its length unknown (whatever a Content-Length beside it says): read it here up to the
        # limit, then hand it on whole (later
        # receives, a disconnect among them, go to the client as before).
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was complete
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send, f"more than {size} bytes")
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: str) -> None:
        message = f"the request body is {size}; the limit is {self.max_bytes} bytes (max_request_bytes)"
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
