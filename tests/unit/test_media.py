"""Images read from URLs (multimodal/media.py): every supported format loads at its size; anything else,
anything broken, too large, or from where the policy does not allow, is a ValueError naming the problem;
the content hash follows the pixels, not the file."""

from __future__ import annotations

import argparse
import base64
import io
import os
import re
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from tokenmill.cli.engine_args import add_dataclass_args
from tokenmill.config import ServerConfig
from tokenmill.multimodal.media import (
    ImageInput, MediaPolicy, check_count, decode_image, image_format, load_image)

POLICY = MediaPolicy()


def encoded(image: Image.Image, kind: str, **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, kind, **save)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB image of pseudo-random pixels (incompressible, so cutting its file loses pixel data)."""
    import random
    rng = random.Random(seed)
    return Image.frombytes("RGB", (width, height), bytes(rng.randrange(256) for _ in range(width * height * 3)))


def png_header(width: int, height: int) -> bytes:
    """A PNG of the given size that is only its signature, IHDR (valid CRC) and IEND: no pixel data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@pytest.mark.parametrize("kind, media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                              ("GIF", "image/gif"), ("BMP", "image/bmp")])
def test_every_supported_format_loads_as_rgb_at_its_size(kind, media_type):
    image = load_image(data_url(encoded(noise(7, 5), kind), media_type), POLICY)
    assert isinstance(image, ImageInput)
    assert (image.width, image.height, image.image.size, image.image.mode) == (7, 5, (7, 5), "RGB")
    assert len(image.content_hash) == 64


def test_a_gif_gives_its_first_frame_and_transparency_is_laid_over_white():
    frames = [Image.new("RGB", (4, 4), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert load_image(data_url(gif, "image/gif"), POLICY).image.getpixel((0, 0)) == (255, 0, 0)
    clear = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    assert load_image(data_url(encoded(clear, "PNG")), POLICY).image.getpixel((1, 1)) == (255, 255, 255)


def test_the_hash_follows_the_pixels_not_the_file():
    pixels = noise(16, 16)
    png = load_image(data_url(encoded(pixels, "PNG")), POLICY)
    assert load_image(data_url(encoded(pixels, "PNG", compress_level=1)), POLICY).content_hash == png.content_hash
    webp = load_image(data_url(encoded(pixels, "WEBP", lossless=True), "image/webp"), POLICY)
    bmp = load_image(data_url(encoded(pixels, "BMP"), "image/bmp"), POLICY)
    assert webp.content_hash == bmp.content_hash == png.content_hash and webp == png
    changed = pixels.copy()
    r, g, b = changed.getpixel((9, 3))
    changed.putpixel((9, 3), (r ^ 1, g, b))
    assert load_image(data_url(encoded(changed, "PNG")), POLICY).content_hash != png.content_hash
    wider = Image.frombytes("RGB", (32, 8), pixels.tobytes())  # the same bytes in another shape
    assert load_image(data_url(encoded(wider, "PNG")), POLICY).content_hash != png.content_hash


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP", "GIF"])
def test_a_truncated_image_is_refused_not_padded(kind):
    whole = encoded(noise(64, 64), kind)
    with pytest.raises(ValueError, match="the image is truncated or corrupt"):
        load_image(data_url(whole[:len(whole) // 2]), POLICY)


@pytest.mark.parametrize("data, says", [
    (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', "an SVG (vector) image"),
    (b'<svg xmlns="http://www.w3.org/2000/svg"></svg>', "an SVG (vector) image"),
    (b"%PDF-1.7\n1 0 obj\n<< /Type /Catalog >>\nendobj\n", "a PDF document"),
    (b"<!DOCTYPE html><html><body>hi</body></html>", "an HTML page"),
    (b"just some words, not a picture", "text"),
    (b"II*\x00" + bytes(64), "a TIFF image"),
    (bytes(range(256)), "unrecognised binary data"),
    (b"", "empty"),
])
def test_other_kinds_of_file_are_named(data, says):
    with pytest.raises(ValueError, match=re.escape(f"the image data is {says}, not an image in a supported format "
                                                   "(PNG, JPEG, WEBP, GIF, BMP)")):
        load_image(data_url(data), POLICY)


def test_a_huge_image_is_refused_from_its_header_before_decoding():
    with pytest.raises(ValueError, match="the image is too large to decode"):
        decode_image(png_header(20000, 20000), POLICY)  # 400M pixels: Pillow's own bomb check, at open
    # 25M pixels: under Pillow's bomb limit, over the policy's; the file has no pixel data, so only a check
    # made before decoding can give this message
    with pytest.raises(ValueError, match=r"5000x5000 = 25000000 pixels; this server takes at most 16777216 "
                                         r"\(--max-image-pixels\)"):
        decode_image(png_header(5000, 5000), POLICY)
    with pytest.raises(ValueError, match="at most 99"):
        decode_image(encoded(noise(10, 10), "PNG"), MediaPolicy(max_image_pixels=99))
    assert image_format(png_header(5000, 5000)) == "PNG"


def test_data_urls_must_be_base64_images_within_the_byte_limit():
    png = encoded(noise(8, 8), "PNG")
    with pytest.raises(ValueError, match="is of type 'text/plain', not an image"):
        load_image(data_url(png, "text/plain"), POLICY)
    with pytest.raises(ValueError, match="not base64"):
        load_image("data:image/png,abc", POLICY)
    with pytest.raises(ValueError, match="invalid base64"):
        load_image("data:image/png;base64,@@@@", POLICY)
    with pytest.raises(ValueError, match="no ','"):
        load_image("data:image/png;base64", POLICY)
    with pytest.raises(ValueError, match="takes images of at most"):
        load_image(data_url(png), MediaPolicy(max_image_bytes=len(png) - 1))
    wrapped = data_url(png).replace("base64,", "base64,\n", 1)  # line breaks in the base64 are skipped
    assert load_image(wrapped, POLICY).width == 8
    with pytest.raises(ValueError, match="is not an image URL"):
        load_image("ftp://example.com/a.png", POLICY)


def test_error_messages_never_echo_a_whole_data_url():
    url = data_url(b"x" * 30000, "text/plain")
    with pytest.raises(ValueError) as refused:
        load_image(url, POLICY)
    assert len(str(refused.value)) < 250 and url[:40] in str(refused.value)


def test_local_files_only_below_the_allowed_folder(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    png = encoded(noise(3, 2), "PNG")
    (allowed / "in.png").write_bytes(png)
    (outside / "out.png").write_bytes(png)
    (allowed / "escape.png").symlink_to(outside / "out.png")
    (allowed / "escape").symlink_to(outside)
    policy = MediaPolicy(allowed_local_media_path=str(allowed))
    assert load_image(f"file://{allowed}/in.png", policy).width == 3
    assert load_image(f"file://localhost{allowed}/in.png", policy).height == 2
    for url in (f"file://{outside}/out.png", f"file://{allowed}/../outside/out.png", f"file://{allowed}/escape.png",
                f"file://{allowed}/escape/out.png", f"file://{outside}/missing.png"):
        with pytest.raises(ValueError, match="outside the folder this server reads images from"):
            load_image(url, policy)
    with pytest.raises(ValueError, match="names no file"):
        load_image(f"file://{allowed}/missing.png", policy)
    with pytest.raises(ValueError, match="names no file"):
        load_image(f"file://{allowed}", policy)
    with pytest.raises(ValueError, match="names a host"):
        load_image(f"file://example.com{allowed}/in.png", policy)
    with pytest.raises(ValueError, match="takes images of at most"):
        load_image(f"file://{allowed}/in.png", MediaPolicy(allowed_local_media_path=str(allowed),
                                                            max_image_bytes=len(png) - 1))
    with pytest.raises(ValueError, match="file:// image URLs are not allowed on this server"):
        load_image(f"file://{allowed}/in.png", POLICY)


class _Images(BaseHTTPRequestHandler):
    """/a.png: a PNG; /big.png: the PNG without a content length; /away: a redirect to another host;
    /here: a redirect to /a.png; /gone: 404."""

    png = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        routes = {"/a.png": (200, {"Content-Length": str(len(self.png))}),
                  "/big.png": (200, {}),
                  "/away": (302, {"Location": f"http://localhost:{port}/a.png"}),
                  "/here": (302, {"Location": "/a.png"}),
                  "/gone": (404, {})}
        status, headers = routes.get(self.path, (404, {}))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if status == 200:
            self.wfile.write(self.png)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def image_host():
    _Images.png = encoded(noise(5, 4), "PNG")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_fetching_is_off_unless_the_host_is_listed(image_host):
    with pytest.raises(ValueError, match="does not fetch images over http"):
        load_image(f"{image_host}/a.png", POLICY)
    with pytest.raises(ValueError, match="the host 'example.com' is not among the domains"):
        load_image("https://example.com/a.png", MediaPolicy(allowed_media_domains=("127.0.0.1",)))
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",))
    assert load_image(f"{image_host}/a.png", policy).width == 5
    assert load_image(f"{image_host}/here", policy).height == 4
    with pytest.raises(ValueError, match="the host 'localhost' is not among the domains"):
        load_image(f"{image_host}/away", policy)
    with pytest.raises(ValueError, match="answered HTTP 404"):
        load_image(f"{image_host}/gone", policy)
    small = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_image_bytes=len(_Images.png) - 1)
    for path in ("/a.png", "/big.png"):  # refused by its Content-Length, and by the bytes as they come
        with pytest.raises(ValueError, match="takes images of at most"):
            load_image(f"{image_host}{path}", small)


def test_a_host_that_does_not_answer_is_a_value_error():
    with pytest.raises(ValueError, match="fetching the image 'http://127.0.0.1:9/a.png' failed"):
        load_image("http://127.0.0.1:9/a.png", MediaPolicy(allowed_media_domains=("127.0.0.1",), fetch_timeout_s=2))


def test_too_many_images_in_one_prompt():
    check_count(8, POLICY)
    with pytest.raises(ValueError) as refused:
        check_count(50, POLICY)
    assert str(refused.value) == "50 images in one prompt; this server takes at most 8 (--limit-mm-per-prompt)"


def test_the_policy_comes_from_the_server_flags(tmp_path):
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, ServerConfig, "server")
    args = parser.parse_args(["--allowed-media-domains", "Images.Example.com", "cdn.example.org",
                              "--allowed-local-media-path", str(tmp_path), "--limit-mm-per-prompt", "3",
                              "--max-image-pixels", "1000", "--media-fetch-timeout", "2.5"])
    config = ServerConfig(**vars(args))
    config.validate()
    assert MediaPolicy.from_config(config) == MediaPolicy(
        allowed_local_media_path=str(tmp_path), allowed_media_domains=("images.example.com", "cdn.example.org"),
        fetch_timeout_s=2.5, max_image_pixels=1000, limit_images_per_prompt=3)
    assert MediaPolicy.from_config(ServerConfig()) == POLICY



def test_the_image_limit_takes_vllms_json_form_too():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, ServerConfig, "server")
    assert parser.parse_args(["--limit-mm-per-prompt", '{"image": 4}']).limit_mm_per_prompt == 4
    assert parser.parse_args(["--limit-mm-per-prompt", '{"image": 2, "video": 0}']).limit_mm_per_prompt == 2
    for bad in ('{"image": 2, "video": 1}', "four", '{"audio": 1}'):
        with pytest.raises(SystemExit):
            parser.parse_args(["--limit-mm-per-prompt", bad])


@pytest.mark.parametrize("fields, says", [
    ({"limit_mm_per_prompt": 0}, "limit_mm_per_prompt must be >= 1"),
    ({"max_image_pixels": 0}, "max_image_pixels must be >= 1"),
    ({"media_fetch_timeout": 0}, "media_fetch_timeout must be > 0"),
    ({"allowed_local_media_path": "/no/such/folder"}, "is not a folder"),
    ({"allowed_local_media_path": os.devnull}, "is not a folder"),
    ({"allowed_media_domains": ["https://example.com/"]}, "takes host names"),
])
def test_bad_media_flags_are_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        ServerConfig(**fields).validate()
