"""Fetching http(s) media URLs (images, videos) safely: only from hosts an operator allowed, never from a private
address unless that address is listed, under a time limit, a byte cap and a redirect cap.

Rules (docs/API.md, "Media URLs"):

- ``--allowed-media-domains`` (vLLM's name) lists what may be fetched, comma- or space-separated. A domain
  entry (``example.com``) allows that host and its subdomains (``cdn.example.com``; not ``badexample.com``);
  an IP address or CIDR entry (``127.0.0.1``, ``10.0.0.0/8``, ``::1``) allows those addresses. Empty (the
  default): every URL is refused, naming the flag.
- The host is resolved here, and every address it resolves to is checked before connecting: a private,
  loopback, link-local, reserved, multicast, unspecified or otherwise non-global address (IPv4-mapped IPv6
  read as its IPv4 address) is refused unless an IP/CIDR entry covers it; a domain entry never unlocks one.
  The connection goes to the checked address (the URL's host stays the ``Host`` header and the TLS server
  name, certificates verified against it), so a DNS answer that changes between check and connect
  (rebinding) cannot redirect it. Redirects are followed by hand, each hop checked the same way.
- One fetch (resolution, connection, redirects, body) is bounded by ``--media-fetch-timeout`` seconds, which
  is also the connect and per-read timeout; the body by the caller's byte cap (the declared length checked
  first, then the bytes as they arrive); the ``Content-Type`` must be one the caller takes.
- Fetched bytes are cached by URL (bounded by bytes, for ``CACHE_TTL_S`` seconds) with their SHA-256, so a
  URL resent within that time is not fetched again; concurrent fetches of one URL share one download. The
  prefix cache keys the media's tokens by the hash of its preprocessed pixels (image_processor.content_hash),
  so a URL whose content changed never reuses the old content's cache entries.

Client: httpx (async, per-phase timeouts, streamed bodies, and the ``sni_hostname`` extension that lets a
request go to a pinned address with the URL's host as TLS server name), with ``trust_env`` off so no proxy
from the environment takes the connection elsewhere.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import socket
import ssl
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from ddtree_serve.server.multimodal.image_processor import ImageError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
FLAG = "--allowed-media-domains"
CACHE_BYTES = 256 << 20
CACHE_TTL_S = 300.0


class MediaFetchError(ImageError):
    """A media URL that cannot be fetched (refused, unreachable, too large, too slow, wrong type): a 400."""


def short(url: str, n: int = 120) -> str:
    return url if len(url) <= n else url[:n] + "..."


def normal_address(addr: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address as its IPv4 address; others as they are."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def is_public(addr: IPAddress) -> bool:
    """False for private, loopback, link-local, reserved, multicast, unspecified and other non-global addresses."""
    a = normal_address(addr)
    return a.is_global and not (a.is_private or a.is_loopback or a.is_link_local or a.is_reserved
                                or a.is_multicast or a.is_unspecified)


@dataclass(frozen=True)
class AllowList:
    """What ``--allowed-media-domains`` allows (module docstring)."""

    domains: tuple[str, ...] = ()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, spec: str | None) -> AllowList:
        """Entries separated by commas or whitespace; ValueError for an empty or malformed one."""
        domains, networks = [], []
        for raw in (spec or "").replace(",", " ").split():
            entry = raw.strip().lower().rstrip(".")
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            if not entry or "/" in entry or ":" in entry or entry.startswith("."):
                raise ValueError(f"{FLAG}: {raw!r} is neither a domain nor an IP address / CIDR range")
            domains.append(entry)
        return cls(tuple(domains), tuple(networks))

    @property
    def empty(self) -> bool:
        return not self.domains and not self.networks

    def listed_address(self, addr: IPAddress) -> bool:
        a = normal_address(addr)
        return any(a.version == n.version and a in n for n in self.networks)

    def allows_name(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in self.domains)


@dataclass(frozen=True)
class FetchLimits:
    timeout_s: float = 10.0
    max_redirects: int = 3


@dataclass(frozen=True)
class Fetched:
    data: bytes
    content_type: str
    sha256: str
    url: str  # the last hop's


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


class MediaFetcher:
    """Fetches media URLs under an ``AllowList`` and ``FetchLimits`` (one per served model; its cache and its
    in-flight downloads live on the instance, used from the server's event loop)."""

    def __init__(self, allow: AllowList, limits: FetchLimits, cache_bytes: int = CACHE_BYTES,
                 cache_ttl_s: float = CACHE_TTL_S, verify: ssl.SSLContext | bool = True) -> None:
        """``verify``: TLS verification (an ``SSLContext`` with other trusted roots: tests)."""
        self.allow, self.limits, self.verify = allow, limits, verify
        self.cache_bytes, self.cache_ttl_s = cache_bytes, cache_ttl_s
        self._cache: OrderedDict[str, tuple[float, Fetched]] = OrderedDict()
        self._cached_bytes = 0
        self._inflight: dict[tuple[str, int, tuple[str, ...]], asyncio.Future[Fetched]] = {}

    async def fetch(self, url: str, max_bytes: int, content_types: tuple[str, ...], what: str = "media") -> Fetched:
        """The body of ``url`` (cached, or shared with a fetch of it in flight); MediaFetchError naming why not.
        A download runs as its own task: a request that goes away does not cancel it for others sharing it."""
        if self.allow.empty:
            raise MediaFetchError(f"{what} URLs are not fetched by this server unless the operator allows their "
                                  f"hosts with {FLAG}; send the {what} inline as a data: URL")
        hit = self._cache.get(url)
        if hit is not None and hit[0] > time.monotonic() and len(hit[1].data) <= max_bytes \
                and _type_ok(hit[1].content_type, content_types):
            self._cache.move_to_end(url)
            return hit[1]
        key = (url, max_bytes, content_types)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._download(url, max_bytes, content_types, what))
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._finished(key, t))
        return await asyncio.shield(task)

    def _finished(self, key: tuple[str, int, tuple[str, ...]], task: asyncio.Future[Fetched]) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled() and task.exception() is None:  # exception(): retrieved, even if nobody awaits
            self._store(key[0], task.result())

    async def _download(self, url: str, max_bytes: int, content_types: tuple[str, ...], what: str) -> Fetched:
        try:
            return await asyncio.wait_for(self._fetch(url, max_bytes, content_types, what), self.limits.timeout_s)
        except asyncio.TimeoutError:
            raise MediaFetchError(f"fetching {what} URL {short(url)} timed out after {self.limits.timeout_s:g} s "
                                  "(--media-fetch-timeout)") from None

    def _store(self, url: str, got: Fetched) -> None:
        if len(got.data) > self.cache_bytes:
            return
        old = self._cache.pop(url, None)
        if old is not None:
            self._cached_bytes -= len(old[1].data)
        self._cache[url] = (time.monotonic() + self.cache_ttl_s, got)
        self._cached_bytes += len(got.data)
        while self._cached_bytes > self.cache_bytes:
            _, (_, dropped) = self._cache.popitem(last=False)
            self._cached_bytes -= len(dropped.data)

    async def _fetch(self, url: str, max_bytes: int, content_types: tuple[str, ...], what: str) -> Fetched:
        import httpx

        t = self.limits.timeout_s
        current = url
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=httpx.Timeout(t),
                                     verify=self.verify) as client:
            for hop in range(self.limits.max_redirects + 1):
                target, headers, ext = await self._pin(current, what)
                try:
                    async with client.stream("GET", target, headers=headers, extensions=ext) as r:
                        if r.status_code in (301, 302, 303, 307, 308) and "location" in r.headers:
                            if hop == self.limits.max_redirects:
                                raise MediaFetchError(f"{what} URL {short(url)} redirects more than "
                                                      f"{self.limits.max_redirects} times (--max-media-redirects)")
                            current = urljoin(current, r.headers["location"])
                            continue
                        if r.status_code != 200:
                            raise MediaFetchError(f"fetching {what} URL {short(url)} failed: HTTP {r.status_code}")
                        ctype = r.headers.get("content-type", "").split(";")[0].strip().lower()
                        if not _type_ok(ctype, content_types):
                            raise MediaFetchError(f"{what} URL {short(url)} has content type {ctype or 'none'!r}; "
                                                  f"accepted: {', '.join(content_types)}")
                        declared = r.headers.get("content-length", "")
                        if declared.isdigit() and int(declared) > max_bytes:
                            raise MediaFetchError(f"{what} URL {short(url)} has {declared} bytes, more than the "
                                                  f"limit of {max_bytes}")
                        data = bytearray()
                        async for piece in r.aiter_bytes():
                            data += piece
                            if len(data) > max_bytes:
                                raise MediaFetchError(f"{what} URL {short(url)} has more than the limit of "
                                                      f"{max_bytes} bytes")
                except httpx.HTTPError as e:
                    raise MediaFetchError(f"fetching {what} URL {short(url)} failed: "
                                          f"{type(e).__name__}: {e or 'no detail'}") from None
                return Fetched(bytes(data), ctype, hashlib.sha256(data).hexdigest(), current)
        raise AssertionError("unreachable")

    async def _pin(self, url: str, what: str) -> tuple[str, dict[str, str], dict[str, str]]:
        """The URL rewritten to a checked address of its host, the ``Host`` header and TLS extension that keep
        the original name; MediaFetchError when the URL or any address of its host is not allowed."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise MediaFetchError(f"{what} URL {short(url)} is not an http(s) URL")
        if parts.username or parts.password:
            raise MediaFetchError(f"{what} URL {short(url)} carries credentials: refused")
        host = parts.hostname.lower()
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise MediaFetchError(f"{what} URL {short(url)} has an invalid port") from None
        literal = _literal(host)
        if literal is not None:
            if not self.allow.listed_address(literal):
                raise MediaFetchError(f"{what} URL host {host} is not allowed ({FLAG} lists no such address)")
            addrs = [literal]
        else:
            if not self.allow.allows_name(host):
                raise MediaFetchError(f"{what} URL host {host} is not in {FLAG}")
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                raise MediaFetchError(f"{what} URL host {host} does not resolve: {e}") from None
            addrs = list(dict.fromkeys(ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos))
            if not addrs:
                raise MediaFetchError(f"{what} URL host {host} does not resolve")
        for a in addrs:
            if not is_public(a) and not self.allow.listed_address(a):
                raise MediaFetchError(f"{what} URL host {host} resolves to the non-public address {a}: refused "
                                      f"(list the address itself in {FLAG} to allow it)")
        addr = normal_address(addrs[0])
        netloc = f"[{addr}]" if addr.version == 6 else str(addr)
        target = parts._replace(netloc=f"{netloc}:{port}").geturl()
        default = port == (443 if parts.scheme == "https" else 80)
        headers = {"host": host if default else f"{host}:{port}", "accept": "*/*"}
        ext = {"sni_hostname": host} if parts.scheme == "https" and literal is None else {}
        return target, headers, ext


def _type_ok(ctype: str, accepted: tuple[str, ...]) -> bool:
    return ctype in accepted
