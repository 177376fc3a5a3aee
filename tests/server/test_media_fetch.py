"""Fetching media URLs (ddtree_serve/server/multimodal/media_fetch.py) against a real loopback HTTP server the test
starts (tests/server/media_server.py): an allowed URL is fetched; a host not listed, a listed domain that
resolves to a private address, a redirect to a private address, too many redirects, too large a body (declared
or streamed), too slow a server, the wrong content type and a 404 are each refused with a MediaFetchError that
says why; with no allow-list nothing is fetched. The address checks themselves: private, loopback, link-local,
reserved, multicast, unspecified and IPv4-mapped IPv6 addresses are not public."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from ddtree_serve.server.multimodal.media_fetch import (
    AllowList,
    FetchLimits,
    MediaFetcher,
    MediaFetchError,
    is_public,
)
from tests.server.image_files import image_bytes, random_image
from tests.server.media_server import media_server

PNG = ("image/png",)


@pytest.fixture(scope="module")
def srv():
    with media_server() as s:
        yield s


def _fetch(fetcher: MediaFetcher, url: str, max_bytes: int = 100_000, types=PNG):
    return asyncio.run(fetcher.fetch(url, max_bytes, types, "image"))


def _fetcher(allow: str = "127.0.0.1", timeout: float = 1.0, redirects: int = 2) -> MediaFetcher:
    return MediaFetcher(AllowList.parse(allow), FetchLimits(timeout, redirects))


def test_allowed_url_is_fetched_and_cached(srv):
    f = _fetcher()
    got = _fetch(f, srv.base + "/img/3.png")
    assert got.data == image_bytes(random_image(3, (84, 56))) and got.content_type == "image/png"
    assert len(got.sha256) == 64
    again = _fetch(f, srv.base + "/img/3.png")
    assert again is got and srv.hits["/img/3.png"] == 1  # the URL's bytes came from the cache


def test_concurrent_fetches_of_one_url_share_one_download(srv):
    f = _fetcher()

    async def many():
        return await asyncio.gather(*(f.fetch(srv.base + "/img/7.png", 100_000, PNG) for _ in range(20)))

    got = asyncio.run(many())
    assert len({g.sha256 for g in got}) == 1 and srv.hits["/img/7.png"] == 1


@pytest.mark.parametrize(("allow", "path", "words"), [
    ("example.com", "/img/1.png", "not allowed"),  # an IP host that is not listed
    ("", "/img/1.png", "--allowed-media-domains"),  # no allow-list: nothing is fetched
    ("127.0.0.2", "/img/1.png", "not allowed"),
])
def test_hosts_not_listed_are_refused(srv, allow, path, words):
    with pytest.raises(MediaFetchError, match=words):
        _fetch(_fetcher(allow), srv.base + path)
    assert srv.hits.get(path, 0) == 0 or allow == "127.0.0.1"


def test_a_listed_domain_that_resolves_to_a_private_address_is_refused(srv):
    with pytest.raises(MediaFetchError, match="non-public address 127.0.0.1"):
        _fetch(_fetcher("localhost"), f"http://localhost:{srv.port}/img/1.png")
    with pytest.raises(MediaFetchError, match="not in --allowed-media-domains"):
        _fetch(_fetcher("example.com"), f"http://localhost:{srv.port}/img/1.png")


def test_redirects_are_checked_hop_by_hop(srv):
    f = _fetcher()
    ok = _fetch(f, srv.base + f"/redirect?to={srv.base}/img/4.png")
    assert ok.data == image_bytes(random_image(4, (84, 56))) and ok.url.endswith("/img/4.png")
    for private in ("http://10.0.0.1/img/1.png", "http://169.254.169.254/latest/meta-data",
                    f"http://localhost:{srv.port}/img/1.png", "http://[::1]/x.png"):
        with pytest.raises(MediaFetchError, match="not allowed|not in --allowed-media-domains"):
            _fetch(f, srv.base + f"/redirect?to={private}")
    with pytest.raises(MediaFetchError, match="redirects more than 2 times"):
        _fetch(f, srv.base + "/loop")
    with pytest.raises(MediaFetchError, match="not an http"):
        _fetch(f, srv.base + "/redirect?to=file:///etc/passwd")


@pytest.mark.parametrize(("path", "words"), [
    ("/big.png", "200004 bytes, more than the limit of 100000"),  # the declared length
    ("/chunked-big.png", "more than the limit of 100000 bytes"),  # counted as it arrives
    ("/page.html", "content type 'text/html'"),
    ("/missing.png", "HTTP 404"),
    ("/fail.png", "HTTP 500"),
])
def test_bad_answers_are_refused(srv, path, words):
    with pytest.raises(MediaFetchError, match=words):
        _fetch(_fetcher(), srv.base + path)


@pytest.mark.parametrize("path", ["/slow.png", "/trickle.png"])
def test_slow_servers_time_out(srv, path):
    with pytest.raises(MediaFetchError, match="timed out after 0.5 s"):
        _fetch(_fetcher(timeout=0.5), srv.base + path)


def test_connection_refused_is_a_fetch_error(srv):
    with pytest.raises(MediaFetchError, match="failed: ConnectError"):
        _fetch(_fetcher("127.0.0.1"), "http://127.0.0.1:1/img.png")


def test_address_classes_and_allow_list_entries():
    for a in ("10.1.2.3", "172.16.0.1", "192.168.1.1", "127.0.0.1", "169.254.169.254", "0.0.0.0", "224.0.0.1",
              "240.0.0.1", "100.64.0.1", "::1", "fe80::1", "fc00::1", "::", "ff02::1", "::ffff:127.0.0.1",
              "::ffff:10.0.0.1"):
        assert not is_public(ipaddress.ip_address(a)), a
    for a in ("93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8"):
        assert is_public(ipaddress.ip_address(a)), a
    allow = AllowList.parse("example.com, 10.0.0.0/8 ::1  127.0.0.1")
    assert allow.allows_name("example.com") and allow.allows_name("cdn.example.com")
    assert not allow.allows_name("badexample.com") and not allow.allows_name("example.com.evil.org")
    assert allow.listed_address(ipaddress.ip_address("10.9.9.9"))
    assert allow.listed_address(ipaddress.ip_address("::ffff:127.0.0.1"))  # IPv4-mapped: read as IPv4
    assert not allow.listed_address(ipaddress.ip_address("127.0.0.2"))
    assert AllowList.parse(None).empty and AllowList.parse(" , ").empty
    for bad in ("http://example.com", ".example.com", "a/b"):
        with pytest.raises(ValueError, match="neither a domain"):
            AllowList.parse(bad)


def test_a_request_that_goes_away_does_not_cancel_a_shared_download(srv):
    f = _fetcher(timeout=6)
    before = srv.hits.get("/slow.png", 0)

    async def go():
        first = asyncio.ensure_future(f.fetch(srv.base + "/slow.png", 100_000, PNG))
        second = asyncio.ensure_future(f.fetch(srv.base + "/slow.png", 100_000, PNG))
        await asyncio.sleep(0.3)
        first.cancel()
        got = await second
        assert first.cancelled()
        return got

    got = asyncio.run(go())
    assert got.data == image_bytes(random_image(1, (84, 56))) and srv.hits["/slow.png"] == before + 1


def test_https_goes_to_the_checked_address_and_verifies_the_urls_name(tmp_path):
    """The URL's host name resolves (localhost -> 127.0.0.1, listed), the connection goes to that address, and
    TLS checks the certificate against the name (SNI): a certificate for the name passes, one for another name
    does not, and an untrusted one does not."""
    import ssl

    from tests.server.media_server import self_signed

    good, other = self_signed(tmp_path, "localhost"), self_signed(tmp_path, "other.example")
    trust = ssl.create_default_context(cafile=str(good[0]))
    trust.load_verify_locations(cafile=str(other[0]))
    allow = AllowList.parse("localhost 127.0.0.1")
    with media_server(tls=good) as s:
        got = asyncio.run(MediaFetcher(allow, FetchLimits(5, 2), verify=trust).fetch(
            f"https://localhost:{s.port}/img/2.png", 100_000, PNG))
        assert got.data == image_bytes(random_image(2, (84, 56)))
        with pytest.raises(MediaFetchError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusted by default
            _fetch(MediaFetcher(allow, FetchLimits(5, 2)), f"https://localhost:{s.port}/img/2.png")
    with media_server(tls=other) as s:
        with pytest.raises(MediaFetchError, match="CERTIFICATE_VERIFY_FAILED|hostname"):  # the name is checked
            _fetch(MediaFetcher(allow, FetchLimits(5, 2), verify=trust), f"https://localhost:{s.port}/img/2.png")
