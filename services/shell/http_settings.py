"""The HTTP server's bounds, as settings every serving process shares (tracker, replica, learner,
evaluator): the same fields, flags and `SPOPP_<SERVICE>_HTTP_*` variables in each."""

from __future__ import annotations

from pydantic import Field

from spopp.settings.base import SettingsGroup

from .connections import ServerLimits

_DEFAULTS = ServerLimits()


class HttpServerSettings(SettingsGroup):
    http_header_timeout_seconds: float = Field(
        _DEFAULTS.header_timeout,
        gt=0,
        le=600,
        description="a request's headers must be complete this long after the connection opens (or "
        "after the previous response); slower clients are disconnected",
    )
    http_body_timeout_seconds: float = Field(
        _DEFAULTS.body_timeout,
        gt=0,
        le=3600,
        description="a request's body must be complete this long after its headers",
    )
    http_idle_timeout_seconds: float = Field(
        _DEFAULTS.idle_timeout,
        gt=0,
        le=3600,
        description="an idle keep-alive connection is closed after this long",
    )
    http_max_connections: int = Field(
        _DEFAULTS.max_connections,
        ge=1,
        le=1_000_000,
        description="open connections at most (lowered to fit the file limit, `ulimit -n`, less 192); "
        "beyond it the connection idle longest is closed, or the newcomer is answered 503 when all are busy",
    )
    http_max_headers: int = Field(
        _DEFAULTS.max_headers,
        ge=1,
        le=10_000,
        description="headers a request may carry; past them it is answered 431 and the connection closed",
    )
    http_max_header_bytes: int = Field(
        _DEFAULTS.max_header_bytes,
        ge=1024,
        le=1 << 20,
        description="bytes of a request's line and headers together; past them it is answered 431 "
        "and the connection closed, as the bytes arrive",
    )
    http_access_log_per_minute: int = Field(
        _DEFAULTS.access_log_per_minute,
        ge=0,
        le=1_000_000,
        description="request lines (uvicorn's access log) written a minute at most, paths cut to 200 "
        "characters; 0: none",
    )
    shutdown_timeout_seconds: float = Field(
        _DEFAULTS.shutdown_timeout,
        gt=0,
        le=3600,
        description="on SIGTERM, requests in flight get this long to finish; the process exits at most "
        "5 s after that, whatever its connections are doing",
    )

    def server_limits(self) -> ServerLimits:
        return ServerLimits(
            header_timeout=self.http_header_timeout_seconds,
            body_timeout=self.http_body_timeout_seconds,
            idle_timeout=self.http_idle_timeout_seconds,
            max_connections=self.http_max_connections,
            shutdown_timeout=self.shutdown_timeout_seconds,
            max_headers=self.http_max_headers,
            max_header_bytes=self.http_max_header_bytes,
            access_log_per_minute=self.http_access_log_per_minute,
        )
