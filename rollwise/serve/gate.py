"""What every request passes before the endpoints see it (an ASGI middleware): the API key,
then the body's size and time. A body is read here, counted as it arrives, and refused with
413 the moment it passes the limit, whether its size was declared (Content-Length) or not (a
chunked body): nothing past the limit is kept in memory; one still arriving after
BODY_TIMEOUT_S gets 408. The endpoints get the body whole."""

from __future__ import annotations

import asyncio
import secrets

from starlette.responses import JSONResponse

from rollwise.serve.protocol import ApiError


def bearer_token(authorization: str) -> str | None:
    """The token of an 'Authorization: Bearer TOKEN' header (the scheme in any case, as
    RFC 9110 says schemes are), or None."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


BODY_TIMEOUT_S = 60.0


class Gate:
    def __init__(self, app, api_key: str | None, limit: int,
                 body_timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.api_key, self.limit = app, api_key, limit
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        refusal = self._refusal(headers)
        if refusal is None:
            try:
                async with asyncio.timeout(self.body_timeout_s):  # a cancel kept, unlike wait_for
                    body = await self._body(receive)
            except TimeoutError:
                body = ApiError(408, f"the body did not arrive whole within "
                                f"{self.body_timeout_s:.0f}s", "body_timeout")
            if body is None:
                return  # the client went away while sending
            if isinstance(body, ApiError):
                refusal = body
        if refusal is not None:
            response = JSONResponse(refusal.body(), status_code=refusal.status,
                                    headers={"connection": "close"})
            return await response(scope, receive, send)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # a streaming response waits here for the disconnect
        return await self.app(scope, replay, send)

    def _refusal(self, headers: dict) -> ApiError | None:
        if self.api_key is not None:
            token = bearer_token(headers.get("authorization", ""))
            if token is None or not secrets.compare_digest(token.encode(),
                                                           self.api_key.encode()):
                return ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                "invalid_api_key", kind="authentication_error")
        size = headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > self.limit):
            return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the body is larger than {self.limit} bytes", "body_too_large")

    async def _body(self, receive) -> bytes | ApiError | None:
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return self._too_large()
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)
