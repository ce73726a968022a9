"""One webhook request, sent only where it may go.

The URL passes the same rule as at registration
(``shared.webhooks.check_url``); a host that is an address in any spelling
is that address, never sent to the resolver. A name is resolved once per
attempt, every address it resolves to is checked
(``shared.webhooks.check_address``), and the connection goes to the
checked address itself: the URL's host is replaced by that address, while
the ``Host`` header and TLS (SNI and certificate check, through httpx's
``sni_hostname`` request extension) still name the original host. So a DNS
answer that changes between the check and the connection (DNS rebinding)
changes nothing. Redirects are not followed: a 3xx is a failed attempt.
Proxies from the environment are ignored, since one would connect elsewhere.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable

import httpx

from shared.webhooks import Address, UnsafeUrl, check_address, check_url


class Answer:
    __slots__ = ("status_code", "retry_after")

    def __init__(self, status_code: int, retry_after: str | None) -> None:
        self.status_code = status_code
        self.retry_after = retry_after


async def resolve(host: str, port: int) -> list[Address]:
    """Every address ``host`` resolves to, in the resolver's order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[Address] = []
    for *_, sockaddr in infos:
        # an IPv6 link-local address may carry a scope ("fe80::1%eth0")
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if address not in found:
            found.append(address)
    return found


async def post(url: str, headers: dict[str, str], payload: bytes, *, allow_private: bool,
               timeout_s: float, ssl_context: ssl.SSLContext,
               resolver: Callable[[str, int], Awaitable[list[Address]]] = resolve) -> Answer:
    """POSTs ``payload``; raises UnsafeUrl before connecting anywhere it must
    not, httpx.HTTPError or OSError when the request fails. ``resolver`` is
    the system's unless a test gives a name several addresses of its own."""
    checked = check_url(url, allow_private=allow_private)
    target = checked.url
    port = target.port or (443 if target.scheme == "https" else 80)
    addresses = [checked.address] if checked.address is not None else await resolver(target.host, port)
    if not addresses:
        raise UnsafeUrl(f"{target.host} resolves to no address")
    for address in addresses:
        try:
            check_address(address, allow_private=allow_private)
        except UnsafeUrl as exc:
            raise UnsafeUrl(f"{target.host} resolves to {address}, which is not a public address") from exc
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    headers = {**headers, "host": target.netloc.decode("ascii")}
    client = httpx.AsyncClient(verify=ssl_context, follow_redirects=False, trust_env=False, timeout=timeout_s)
    async with client:
        # each checked address in the resolver's order, until one accepts the connection
        for n, address in enumerate(addresses, start=1):
            try:
                async with client.stream("POST", target.copy_with(host=str(address)), content=payload,
                                         headers=headers, extensions=extensions) as response:
                    # the body is not read: only the status and Retry-After count
                    return Answer(response.status_code, response.headers.get("retry-after"))
            except httpx.ConnectError:
                if n == len(addresses):
                    raise
    raise AssertionError("unreachable: addresses is not empty")
