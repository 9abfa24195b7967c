"""Fetching a picture a request names (issue 34): a security boundary, as vLLM's media
connector is one. `data:` URLs are decoded here; http(s) URLs are fetched through httpx
with a timeout (the whole fetch, however slowly the server drips), a size cap and a
redirect cap, only from --allowed-media-domains when given (every redirect's target
checked too); `file://` URLs are read only under --allowed-local-media-path. Every
refusal is a MediaError naming the part, which render turns into a 400 before the reply
starts. Synchronous: render runs requests with pictures in a worker thread."""
from __future__ import annotations

import base64
import binascii
import os
import time
import urllib.parse
from pathlib import Path

import attrs

DEFAULT_FETCH_TIMEOUT_S = 5.0          # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_REDIRECTS = 5
DEFAULT_IMAGE_LIMIT = 999              # pictures per prompt, when --limit-mm-per-prompt says none


class MediaError(ValueError):
    """A picture that cannot be had: the message and the part it names."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@attrs.frozen
class MediaSettings:
    """The media flags, as render reads them."""
    allowed_domains: tuple[str, ...] = ()        # empty: any host
    allowed_local_path: str | None = None        # file:// only beneath it; None: never
    limits: tuple[tuple[str, int], ...] = ()     # --limit-mm-per-prompt, per modality
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_BYTES
    max_redirects: int = DEFAULT_MAX_REDIRECTS

    def limit(self, modality: str) -> int:
        return dict(self.limits).get(modality, DEFAULT_IMAGE_LIMIT)


def load(url: object, settings: MediaSettings, param: str) -> bytes:
    """The bytes a part's URL names, or MediaError."""
    if not isinstance(url, str) or not url:
        raise MediaError(f"'{param}' must be a non-empty URL string.", param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, settings, param)
    if scheme in ("http", "https"):
        return _fetch(url, settings, param)
    if scheme == "file":
        return _local(url, settings, param)
    raise MediaError(f"'{param}' must be an http(s) URL, a data: URL or (with "
                     f"--allowed-local-media-path) a file:// URL, got {url[:40]!r}.", param)


def _data_url(url: str, settings: MediaSettings, param: str) -> bytes:
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError(f"'{param}' is a data: URL without a ',' before its data.", param)
    mediatype, *params = head.split(";")
    if mediatype and not mediatype.lower().startswith("image/"):
        raise MediaError(f"'{param}' is a data: URL of {mediatype!r}, not an image.", param)
    if "base64" not in (p.lower() for p in params):
        data = urllib.parse.unquote_to_bytes(payload)
    else:
        if len(payload) * 3 // 4 > settings.max_bytes:
            raise MediaError(f"'{param}' is larger than the {settings.max_bytes}-byte limit on "
                             "media.", param)
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise MediaError(f"'{param}' is not valid base64.", param) from None
    if len(data) > settings.max_bytes:
        raise MediaError(f"'{param}' is larger than the {settings.max_bytes}-byte limit on "
                         "media.", param)
    return data


def _host_allowed(host: str | None, settings: MediaSettings) -> bool:
    if not settings.allowed_domains:
        return True
    host = (host or "").lower().rstrip(".")
    return any(host == d.lower().rstrip(".") for d in settings.allowed_domains)


def _fetch(url: str, settings: MediaSettings, param: str) -> bytes:
    import httpx

    host = urllib.parse.urlsplit(url).hostname
    if not _host_allowed(host, settings):
        raise MediaError(f"'{param}': the domain {host!r} is not in --allowed-media-domains.",
                         param)

    def check(request: httpx.Request) -> None:   # every request, redirects' targets too
        if not _host_allowed(request.url.host, settings):
            raise MediaError(f"'{param}': redirected to {request.url.host!r}, which is not in "
                             "--allowed-media-domains.", param)

    deadline = time.monotonic() + settings.fetch_timeout_s
    timeout = httpx.Timeout(settings.fetch_timeout_s)
    try:
        with httpx.Client(timeout=timeout, follow_redirects=settings.max_redirects > 0,
                          max_redirects=settings.max_redirects, trust_env=False,
                          event_hooks={"request": [check]}) as client:
            with client.stream("GET", url) as resp:
                if resp.status_code >= 400:
                    raise MediaError(f"'{param}': fetching {url[:200]} answered HTTP "
                                     f"{resp.status_code}.", param)
                if resp.is_redirect:
                    raise MediaError(f"'{param}': {url[:200]} redirects more than "
                                     f"{settings.max_redirects} times.", param)
                size = resp.headers.get("content-length")
                if size is not None and size.isdigit() and int(size) > settings.max_bytes:
                    raise MediaError(f"'{param}' is larger than the {settings.max_bytes}-byte "
                                     "limit on media.", param)
                chunks, total = [], 0
                for chunk in resp.iter_bytes():
                    total += len(chunk)
                    if total > settings.max_bytes:
                        raise MediaError(f"'{param}' is larger than the {settings.max_bytes}-"
                                         "byte limit on media.", param)
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the whole fetch took too long")
                    chunks.append(chunk)
                return b"".join(chunks)
    except MediaError:
        raise
    except httpx.TooManyRedirects:
        raise MediaError(f"'{param}': {url[:200]} redirects more than "
                         f"{settings.max_redirects} times.", param) from None
    except httpx.TimeoutException:
        raise MediaError(f"'{param}': fetching {url[:200]} timed out after "
                         f"{settings.fetch_timeout_s:g} s.", param) from None
    except httpx.HTTPError as exc:
        raise MediaError(f"'{param}': fetching {url[:200]} failed: {exc}", param) from None


def _local(url: str, settings: MediaSettings, param: str) -> bytes:
    if settings.allowed_local_path is None:
        raise MediaError(f"'{param}': file:// URLs are refused (the server was not started "
                         "with --allowed-local-media-path).", param)
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"'{param}': a file:// URL must name a local path.", param)
    root = Path(os.path.realpath(settings.allowed_local_path))
    path = Path(os.path.realpath(urllib.parse.unquote(parts.path)))
    if path != root and root not in path.parents:
        raise MediaError(f"'{param}': {path} is not under --allowed-local-media-path.", param)
    try:
        if path.stat().st_size > settings.max_bytes:
            raise MediaError(f"'{param}' is larger than the {settings.max_bytes}-byte limit on "
                             "media.", param)
        return path.read_bytes()
    except OSError as exc:
        raise MediaError(f"'{param}': cannot read {path}: {exc.strerror}.", param) from None
