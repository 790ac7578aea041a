"""Decoding one image: modes converted (not dropped), bad inputs refused with a reason."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from raydiff.data.decode import BadImage, decode_resize_crop, dense_array, fit_array


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


def _pgm16(array: np.ndarray) -> bytes:
    """A 16-bit PGM (maxval 65535), which Pillow opens in mode "I" as it did 16-bit PNGs before 10.3."""
    return b"P5\n%d %d\n65535\n" % (array.shape[1], array.shape[0]) + array.astype(">u2").tobytes()


@pytest.mark.parametrize("fmt", ["PGM", "PNG"])
def test_a_16_bit_value_decodes_alike_whatever_the_images_other_pixels(fmt):
    def decoded(array: np.ndarray) -> np.ndarray:
        data = _pgm16(array) if fmt == "PGM" else encode(Image.fromarray(array))
        return decode_resize_crop(data, 16, 1)[0, 4:12, 4:12]  # away from the bright corner's blur

    dim = np.full((16, 16), 200, np.uint16)  # all at most 255, which does not make it an 8-bit image
    with_a_bright_corner = dim.copy()
    with_a_bright_corner[0, 0] = 65535
    assert np.all(decoded(dim) == round(200 / 257)) and np.all(decoded(with_a_bright_corner) == round(200 / 257))
    assert np.all(decoded(np.full((16, 16), 40000, np.uint16)) == round(40000 / 257))


def test_integer_images_of_other_depths_are_refused_naming_the_depth():
    thirty_two_bit = encode(Image.fromarray(np.full((16, 16), 70000, np.int32)), "TIFF")
    with pytest.raises(BadImage, match=r"^a TIFF of 32-bit or signed integer pixels \(I;32S\): only 8- and 16-bit "
                                       r"unsigned ones have a standard 8-bit scale$"):
        decode_resize_crop(thirty_two_bit, 8, 1)


def _tiff_with_text_strip_offsets() -> bytes:
    """A TIFF whose StripOffsets tag says its type is ASCII, not LONG: PIL reads the offset as a str and its
    ImageFile.load raises TypeError, no error PIL documents for a bad file."""
    data = bytearray(encode(Image.new("L", (4, 4), 7), "TIFF"))
    entry = data.find(b"\x11\x01\x04\x00")  # tag 273 (StripOffsets), type 4 (LONG), little-endian
    data[entry + 2] = 2  # type 2: ASCII
    with pytest.raises(TypeError), Image.open(io.BytesIO(bytes(data))) as opened:
        opened.load()
    return bytes(data)


def test_a_file_pil_fails_on_in_any_way_is_a_bad_image_with_its_reason():
    with pytest.raises(BadImage, match=r"^cannot decode: 'str' object cannot be interpreted as an integer$"):
        decode_resize_crop(_tiff_with_text_strip_offsets(), 8, 1)


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


def test_nested_rows_of_a_tensor_become_one_array_and_ragged_ones_a_bad_image():
    """A Parquet column of nested lists reaches a batch as object arrays of object arrays (Ray Data's numpy
    batches); fit_array read their dtype, object, as a bad image's, and every image of such a source was bad."""
    hwc = np.random.default_rng(1).integers(0, 256, (8, 6, 3), dtype=np.uint8)
    rows = np.empty(8, dtype=object)
    for i, row in enumerate(hwc):
        rows[i] = np.empty(6, dtype=object)
        rows[i][:] = list(row)
    dense = dense_array(rows)
    assert dense.dtype == np.uint8 and np.array_equal(dense, hwc)
    assert dense_array(hwc) is hwc
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.zeros(3, np.uint8), np.zeros(4, np.uint8)]
    for bad in (ragged, np.empty(0, dtype=object), np.array(None, dtype=object)):
        with pytest.raises(BadImage, match="expected an image"):
            dense_array(bad)
    with_a_null = np.empty(2, dtype=object)
    with_a_null[:] = [np.zeros(3, np.uint8), None]
    with pytest.raises(BadImage, match="^an empty or null tensor"):  # named as null, not as ragged
        dense_array(with_a_null)


def test_a_16_bit_grayscale_png_s_transparent_value_is_put_over_white():
    """Its transparency is a 16-bit value (tRNS): scaling to 8 bits dropped it, and the transparent pixels were
    black (0), where 8-bit grayscale and 16-bit RGB ones are white."""
    array = np.full((16, 16), 40000, np.uint16)
    array[:, :8] = 0  # the left half: the transparent value
    data = encode(Image.fromarray(array), transparency=0)
    assert Image.open(io.BytesIO(data)).info.get("transparency") == 0  # as written
    decoded = decode_resize_crop(data, 16, 1)[0]
    assert np.all(decoded[:, :6] == 255) and np.all(decoded[:, 10:] == round(40000 / 257))
