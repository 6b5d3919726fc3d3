"""What the gateway's client to the replicas (:mod:`orchestrator.gateway.upstream`) raises, split the way the proxy
retries: nothing was sent, or the connection broke."""


class UpstreamError(Exception):
    """Base of what :class:`~.upstream.Upstream` raises."""


class ConnectFailed(UpstreamError):
    """The replica could not be reached (refused, unroutable, connect timeout)."""


class UpstreamFailed(UpstreamError):
    """The connection broke or the replica sent something that is not HTTP."""


class UpstreamTimeout(UpstreamFailed):
    """No response headers within the first-byte timeout, or no end within the request timeout."""
