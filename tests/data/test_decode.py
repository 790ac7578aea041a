"""Decoding one image: modes converted (not dropped), bad inputs refused with a reason."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from raydiff.data.decode import BadImage, decode_resize_crop, fit_array


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def test_resize_covers_then_center_crops():
    image = Image.new("RGB", (40, 20), (0, 0, 0))
    image.paste((255, 0, 0), (10, 0, 30, 20))  # the central square is red
    out = decode_resize_crop(encode(image), 8, 3)
    assert out.shape == (3, 8, 8) and out.dtype == np.uint8
    assert np.all(out[0][:, 1:-1] == 255) and np.all(out[1][:, 1:-1] == 0)  # bicubic blurs only the edges


def test_cmyk_jpeg_becomes_rgb():
    out = decode_resize_crop(encode(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95), 8, 3)
    assert out[0].mean() > 200 and out[1].mean() < 60 and out[2].mean() < 60  # red


def test_16_bit_grayscale_is_scaled_not_clipped():
    array = np.full((16, 16), 32768, np.uint16)  # half of the 16-bit range
    out = decode_resize_crop(encode(Image.fromarray(array)), 8, 1)
    assert out.shape == (1, 8, 8) and abs(int(out.mean()) - 127) <= 1


def test_transparency_is_composited_over_white():
    rgba = Image.new("RGBA", (16, 16), (0, 0, 0, 0))
    rgba.paste((0, 0, 255, 255), (0, 0, 8, 16))  # left half opaque blue, right half transparent black
    out = decode_resize_crop(encode(rgba), 16, 3)
    assert np.all(out[:, :, 12:] == 255) and np.all(out[2, :, :4] == 255) and np.all(out[0, :, :4] == 0)
    palette = rgba.convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = palette.getpixel((15, 0))
    out = decode_resize_crop(encode(palette, transparency=palette.info["transparency"]), 16, 3)
    assert np.all(out[:, :, 12:] == 255)
    assert np.all(decode_resize_crop(encode(rgba.convert("LA")), 16, 1)[:, :, 12:] == 255)


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (16, 8), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 8, 8))  # white on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed: white on top
    out = decode_resize_crop(encode(image, "JPEG", exif=exif, quality=95), 8, 1)
    assert out[0, :2].mean() > 200 and out[0, -2:].mean() < 60


@pytest.mark.parametrize("data, reason", [
    (b"", "empty file"),
    (b"hello, not an image", "not an image"),
    (encode(Image.new("RGB", (64, 64), (1, 2, 3)), "JPEG")[:300], "cannot decode"),
    (encode(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG")[:60], "cannot decode"),
])
def test_bad_inputs_raise_with_a_reason(data, reason):
    with pytest.raises(BadImage, match=reason):
        decode_resize_crop(data, 8, 3)


def test_fit_array_accepts_chw_hwc_and_grayscale():
    chw = np.random.default_rng(0).integers(0, 256, (3, 8, 8), dtype=np.uint8)
    assert fit_array(chw, 8, 3) is chw  # already the right shape: untouched
    assert np.array_equal(fit_array(chw.transpose(1, 2, 0), 8, 3), chw)
    assert fit_array(np.zeros((20, 10), np.uint8), 4, 1).shape == (1, 4, 4)
    with pytest.raises(BadImage, match="dtype float32"):
        fit_array(np.zeros((8, 8), np.float32), 8, 1)
    with pytest.raises(BadImage, match="expected an image"):
        fit_array(np.zeros((2, 8, 8, 3), np.uint8), 8, 3)
