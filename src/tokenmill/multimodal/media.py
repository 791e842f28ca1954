"""Images from the URLs requests give (data:, file://, http(s)://): read within the server's media policy,
decoded whole by Pillow, checked, and hashed by their pixels.

Every failure is a ValueError that names what is wrong and shows at most SHOWN_CHARS characters of the URL
(a data URL may be megabytes long).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional
from urllib.parse import unquote, urljoin, urlsplit

import httpx
from PIL import Image

if TYPE_CHECKING:
    from tokenmill.config import ServerConfig

MiB = 1024 * 1024
SHOWN_CHARS = 60
MAX_REDIRECTS = 3
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_MAGIC = (("PNG", b"\x89PNG\r\n\x1a\n"), ("JPEG", b"\xff\xd8\xff"), ("GIF", b"GIF87a"), ("GIF", b"GIF89a"),
          ("BMP", b"BM"))
_WHITE = (255, 255, 255)


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how big they may be. `allowed_local_media_path`: file:// URLs are read
    only below this folder (after resolving symlinks), and not at all without it; `allowed_media_domains`:
    the hosts http(s) URLs may name (none: no fetching); `max_image_pixels` is checked from the image's
    header, before it is decoded."""

    allowed_local_media_path: Optional[str] = None
    allowed_media_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0
    max_image_bytes: int = 20 * MiB
    max_image_pixels: int = 4096 * 4096
    limit_images_per_prompt: int = 8

    @classmethod
    def from_config(cls, config: ServerConfig) -> MediaPolicy:
        """The policy of a server started with `config`'s flags."""
        return cls(allowed_local_media_path=config.allowed_local_media_path,
                   allowed_media_domains=tuple(d.lower() for d in config.allowed_media_domains or ()),
                   fetch_timeout_s=config.media_fetch_timeout, max_image_pixels=config.max_image_pixels,
                   limit_images_per_prompt=config.limit_mm_per_prompt)


@dataclass(frozen=True)
class ImageInput:
    """A decoded image: RGB pixels (transparency laid over white), its size, and `content_hash`, the sha256 of
    its mode, size and pixels: images that differ in one pixel hash differently, and the same pixels hash the
    same whatever file format carried them (the key the prefix cache will give an image's blocks)."""

    image: Image.Image = field(compare=False, repr=False)
    width: int
    height: int
    content_hash: str


def load_image(url: str, policy: MediaPolicy) -> ImageInput:
    """The image at `url` (a data:image/...;base64 URL, a file:// URL below the allowed folder, or an
    http(s):// URL of an allowed domain), decoded and checked; ValueError naming the problem. Blocking:
    call it off the event loop."""
    return decode_image(read_image_bytes(url, policy), policy)


def read_image_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The bytes `url` holds, at most policy.max_image_bytes of them; ValueError when the policy does not
    let the server read it, or reading fails."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, policy)
    if scheme == "file":
        return _local_file(url, policy)
    if scheme in ("http", "https"):
        return _fetched(url, policy)
    raise ValueError(f"{shown(url)!r} is not an image URL: give a data:image/<type>;base64,... URL, a file:// URL "
                     "or an http(s):// URL")


def decode_image(data: bytes, policy: MediaPolicy) -> ImageInput:
    """`data` decoded whole as one of FORMATS (a GIF's or WEBP's first frame); ValueError when it is another
    kind of file, larger than policy.max_image_pixels (read from the header, before decoding), truncated
    or corrupt."""
    kind = image_format(data)
    try:
        opened = Image.open(io.BytesIO(data), formats=[kind])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(f"the image is too large to decode ({exc}); this server takes at most "
                         f"{policy.max_image_pixels} pixels (--max-image-pixels)") from None
    except Exception as exc:  # Pillow's parsers raise many kinds for bad headers
        raise ValueError(f"the image is truncated or corrupt: {kind} header unreadable ({exc})") from None
    with opened:
        width, height = opened.size
        if width < 1 or height < 1:
            raise ValueError(f"the image is {width}x{height} pixels: it has no pixels")
        if width * height > policy.max_image_pixels:
            raise ValueError(f"the image is {width}x{height} = {width * height} pixels; this server takes at most "
                             f"{policy.max_image_pixels} (--max-image-pixels)")
        try:
            # decodes every pixel: with Pillow's ImageFile.LOAD_TRUNCATED_IMAGES False (its default, which
            # tokenmill never changes), missing or broken data raises here instead of loading as grey
            opened.load()
            image = _rgb(opened)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ValueError(f"the image is too large to decode ({exc})") from None
        except Exception as exc:  # Pillow's decoders raise OSError, SyntaxError, ValueError, EOFError, ...
            raise ValueError(f"the image is truncated or corrupt: {kind}: {exc}") from None
    return ImageInput(image, width, height, pixel_hash(image))


def image_input(image: Image.Image) -> ImageInput:
    """A PIL image given in process (`LLM.generate`'s multi_modal_data) as the engine takes images: RGB
    (transparency laid over white), hashed by its pixels. ValueError for an image without pixels."""
    if not isinstance(image, Image.Image):
        raise ValueError(f"an image must be a PIL.Image.Image, got {type(image).__name__}")
    if image.width < 1 or image.height < 1:
        raise ValueError(f"the image is {image.width}x{image.height} pixels: it has no pixels")
    rgb = _rgb(image)
    return ImageInput(rgb, rgb.width, rgb.height, pixel_hash(rgb))


def pixel_hash(image: Image.Image) -> str:
    """The sha256 (hex) of `image`'s mode, size and pixels."""
    digest = hashlib.sha256(f"{image.mode} {image.width}x{image.height}\n".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def image_format(data: bytes) -> str:
    """Which of FORMATS `data` is, by its leading bytes; ValueError saying what it is otherwise."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for kind, magic in _MAGIC:
        if data.startswith(magic):
            return kind
    raise ValueError(f"the image data is {_what(data)}, not an image in a supported format "
                     f"({', '.join(FORMATS)})")


def check_count(count: int, policy: MediaPolicy) -> None:
    """ValueError when one prompt holds more images than the policy takes."""
    if count > policy.limit_images_per_prompt:
        raise ValueError(f"{count} images in one prompt; this server takes at most {policy.limit_images_per_prompt} "
                         "(--limit-mm-per-prompt)")


def shown(url: str) -> str:
    """`url` as an error message may show it: at most SHOWN_CHARS characters."""
    return url if len(url) <= SHOWN_CHARS else url[:SHOWN_CHARS - 3] + "..."


def _what(data: bytes) -> str:
    """A description of bytes that are not a supported image."""
    if not data:
        return "empty"
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith(b"%pdf"):
        return "a PDF document"
    if b"<svg" in head:
        return "an SVG (vector) image"
    if head.startswith((b"<!doctype html", b"<html")):
        return "an HTML page"
    if head.startswith(b"<?xml"):
        return "an XML document"
    if data.startswith((b"II*\x00", b"MM\x00*")):
        return "a TIFF image"
    if data[4:8] == b"ftyp":
        return "an ISO media file (HEIC, AVIF or video)"
    try:
        data[:1024].decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason != "unexpected end of data":  # not just a character cut at the 1024th byte
            return "unrecognised binary data"
    return "unrecognised binary data" if b"\x00" in data[:1024] else "text"


def _rgb(image: Image.Image) -> Image.Image:
    """`image` as RGB, any transparency laid over white (as vLLM does)."""
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, _WHITE)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB")


def _too_big(size: int, policy: MediaPolicy) -> ValueError:
    return ValueError(f"the image is {size / MiB:.1f} MiB or more; this server takes images of at most "
                      f"{policy.max_image_bytes / MiB:.1f} MiB")


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise ValueError(f"the data URL {shown(url)!r} has no ',' before its data")
    media_type, *params = header[len("data:"):].split(";")
    media_type = media_type.strip().lower()
    if not media_type.startswith("image/"):
        raise ValueError(f"the data URL {shown(url)!r} is of type {media_type or 'text/plain'!r}, not an image: give "
                         "data:image/<type>;base64,...")
    if "base64" not in (p.strip().lower() for p in params):
        raise ValueError(f"the data URL {shown(url)!r} is not base64: give data:image/<type>;base64,...")
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 > policy.max_image_bytes + 2:
        raise _too_big(len(payload) // 4 * 3, policy)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the data URL {shown(url)!r} holds invalid base64 ({exc})") from None
    if len(data) > policy.max_image_bytes:
        raise _too_big(len(data), policy)
    return data


def _local_file(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_media_path is None:
        raise ValueError(f"file:// image URLs are not allowed on this server ({shown(url)!r}); its operator may "
                         "allow a folder with --allowed-local-media-path")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"the file URL {shown(url)!r} names a host ({parts.netloc!r}): give file:///path")
    if not parts.path.startswith("/"):
        raise ValueError(f"the file URL {shown(url)!r} is not an absolute path: give file:///path")
    try:
        root = Path(policy.allowed_local_media_path).resolve()
        path = Path(unquote(parts.path)).resolve()  # symlinks followed: where the bytes really are
        inside = path.is_relative_to(root)
        is_file = inside and path.is_file()
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"the file URL {shown(url)!r} cannot be read: {exc}") from None
    if not inside:
        raise ValueError(f"the file URL {shown(url)!r} is outside the folder this server reads images from "
                         "(--allowed-local-media-path)")
    if not is_file:
        raise ValueError(f"the file URL {shown(url)!r} names no file")
    try:
        with open(path, "rb") as handle:
            data = handle.read(policy.max_image_bytes + 1)
    except OSError as exc:
        raise ValueError(f"the file URL {shown(url)!r} cannot be read: {exc.strerror}") from None
    if len(data) > policy.max_image_bytes:
        raise _too_big(len(data), policy)
    return data


def _allowed_host(url: str, policy: MediaPolicy) -> None:
    if not policy.allowed_media_domains:
        raise ValueError(f"this server does not fetch images over http(s) ({shown(url)!r}): send the image as a "
                         "data:image/<type>;base64 URL; its operator may allow hosts with --allowed-media-domains")
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme.lower() not in ("http", "https") or host not in policy.allowed_media_domains:
        raise ValueError(f"{shown(url)!r}: the host {host!r} is not among the domains this server fetches images "
                         "from (--allowed-media-domains)")


def _fetched(url: str, policy: MediaPolicy) -> bytes:
    """The body of a GET of `url`, following at most MAX_REDIRECTS redirects, each to an allowed host; the
    whole fetch ends after policy.fetch_timeout_s (httpx's timeout bounds each connect and read)."""
    _allowed_host(url, policy)
    deadline = time.monotonic() + policy.fetch_timeout_s
    try:
        with httpx.Client(timeout=policy.fetch_timeout_s, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                with client.stream("GET", url) as response:
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        _allowed_host(url, policy)
                        continue
                    if response.status_code != 200:
                        raise ValueError(f"fetching the image {shown(url)!r} answered HTTP {response.status_code}")
                    return _body(response, url, policy, deadline)
    except httpx.HTTPError as exc:
        raise ValueError(f"fetching the image {shown(url)!r} failed: {type(exc).__name__} {exc}") from None
    raise ValueError(f"fetching the image {shown(url)!r} was redirected more than {MAX_REDIRECTS} times")


def _body(response: httpx.Response, url: str, policy: MediaPolicy, deadline: float) -> bytes:
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > policy.max_image_bytes:
        raise _too_big(int(length), policy)
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > policy.max_image_bytes:
            raise _too_big(size, policy)
        if time.monotonic() > deadline:
            raise ValueError(f"fetching the image {shown(url)!r} took more than {policy.fetch_timeout_s} s")
        chunks.append(chunk)
    return b"".join(chunks)
