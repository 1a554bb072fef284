"""Bounds on a request's HTTP head, before any route (and before the API key) sees it.

uvicorn's httptools parser (the fast one, used when httptools is installed) buffers header bytes
without limit and waits for them without a deadline: one connection that sent `X-Big: ` and then
300 MB of `a` grew the server by 250 MB, and 3,000 half-sent heads were held forever (reliability
probe round 4, M6). h11, the pure-Python parser, stops at 16 KB. This protocol counts the bytes of
each request's head as they arrive and answers 431 past `max_header_bytes`, and closes a connection
whose head is not complete `header_timeout` seconds after it began (cpp-httplib, llama.cpp's server,
refuses header lines over 8 KB; nginx gives a head 60 s).
"""

from __future__ import annotations

DEFAULT_HEADER_TIMEOUT = 30.0


def _response(status: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def bounded_httptools(max_header_bytes: int, header_timeout: float = DEFAULT_HEADER_TIMEOUT):
    """uvicorn's HttpToolsProtocol, with the head bounded in size and in time (a class for
    uvicorn.Config(http=...))."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # in_head: the next bytes belong to a request's head; head_bytes: how many of it came so far
            self._in_head, self._head_bytes, self._head_timer = True, 0, None

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
                if self._head_timer is None:
                    self._head_timer = self.loop.call_later(header_timeout, self._head_too_slow)
            super().data_received(data)
            # counted per read, checked after the parser saw it: a read that also ended the head is fine
            if self._in_head and self._head_bytes > max_header_bytes and not self.transport.is_closing():
                self.logger.warning("a request's head passed %d bytes: 431, connection closed", max_header_bytes)
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request's headers are larger than {max_header_bytes} bytes")

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            self._cancel_timer()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes = True, 0  # a pipelined or keep-alive request's head comes next

        def connection_lost(self, exc) -> None:
            self._cancel_timer()
            super().connection_lost(exc)

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self._in_head and self._head_bytes and not self.transport.is_closing():
                self._refuse(408, "Request Timeout", f"the request's headers took more than {header_timeout:g} s")

        def _cancel_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _refuse(self, status: int, reason: str, message: str) -> None:
            self.transport.write(_response(status, reason, message))
            self.transport.close()
            self.parser = None  # what it buffered goes now, not when the peer closes

    return BoundedHttpToolsProtocol


def http_protocol(http: str, max_header_bytes: int) -> tuple[object, dict]:
    """uvicorn's `http` choice made bounded -> (Config's http, extra Config kwargs)."""
    if http == "httptools":
        return bounded_httptools(max_header_bytes), {}
    return http, {"h11_max_incomplete_event_size": max_header_bytes}
