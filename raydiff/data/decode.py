"""One encoded image -> uint8 (C, R, R): decode, convert the mode, scale to cover R x R, center-crop.

Pure PIL/numpy, no Ray: `raydiff.data.image_store` runs it inside Ray Data tasks. Images in awkward modes are converted
rather than dropped: CMYK and YCbCr become RGB, palette images are expanded, 16-bit images are scaled to 8 bits
(not clipped), float images are clipped to [0, 255], transparent pixels are composited over white, and EXIF
orientation is applied. The scale comes from the file's bit depth, never from its pixels, so that a value decodes
alike in every image; integer images of other depths (32-bit, signed) have no standard scale and are refused.
Whatever cannot be decoded (truncated, corrupt, empty, not an image, too big: see `Image.MAX_IMAGE_PIXELS`),
whichever error PIL raises for it, raises `BadImage` with a short reason, so that the caller can skip and count it.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

BACKGROUND = 255  # transparent pixels become white, the usual background of images with an alpha channel


class BadImage(ValueError):
    """This input is not a usable image; the message is a short reason (for reports, not a traceback)."""


# The formats whose "I" images hold 16-bit pixels, 0..65535: PNG's 16-bit grayscale in older Pillow (I;16 in newer
# ones), and PGM's whatever its maxval (Pillow scales it to 65535).
_SIXTEEN_BIT_FORMATS = ("PNG", "PPM")
_SIXTEEN_BIT_RAWMODES = ("I;16", "I;16L", "I;16B", "I;16N")


def _check_integer_depth(opened: ImageFile.ImageFile) -> None:
    """An image PIL holds as 32-bit ints ("I"), before it is loaded: pass when its file's pixels are unsigned 16-bit
    (then scaled like I;16), else BadImage, as its depth, not its pixels, must choose the scale."""
    if opened.mode != "I" or opened.format in _SIXTEEN_BIT_FORMATS:
        return
    args = opened.tile[0][3] if opened.tile else None  # (codec, extents, offset, args): a tuple before Pillow 11
    rawmode = args if isinstance(args, str) else str(args[0]) if args else None
    if rawmode not in _SIXTEEN_BIT_RAWMODES:
        raise BadImage(f"a {opened.format} of 32-bit or signed integer pixels ({rawmode or opened.mode}): only 8- and "
                       f"16-bit unsigned ones have a standard 8-bit scale")


def _to_8bit(image: Image.Image) -> Image.Image:
    """16-bit ("I;16*", or "I" that `_check_integer_depth` passed) and float modes -> 8-bit L, keeping the full range
    (PIL's convert would clip)."""
    array = np.asarray(image)
    if image.mode != "F":
        array = array.astype(np.float64) / 257.0  # 0..65535 -> 0..255, whatever the image's other pixels
    return Image.fromarray(np.clip(np.rint(array), 0, 255).astype(np.uint8), mode="L")


def _flatten(image: Image.Image, mode: str) -> Image.Image:
    """Any PIL image -> `mode` ("L" or "RGB"), alpha composited over the background."""
    if image.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N", "F"):
        key = image.info.get("transparency")  # a 16-bit grayscale PNG's tRNS: the one value that is transparent
        eight = _to_8bit(image)
        if isinstance(key, int) and image.mode != "F":
            alpha = Image.fromarray(np.where(np.asarray(image) == key, 0, 255).astype(np.uint8), mode="L")
            eight = Image.merge("LA", (eight, alpha))
        image = eight
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    transparent = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if transparent:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (BACKGROUND,) * 3 + (255,))
        image = Image.alpha_composite(background, rgba)
    return image.convert(mode)


def decode_resize_crop(data: bytes, resolution: int, channels: int) -> np.ndarray:
    """Encoded bytes -> uint8 (C, R, R): scaled to cover R x R (antialiased bicubic), center-cropped.
    Raises BadImage for anything that is not a decodable image."""
    if not data:
        raise BadImage("empty file")
    mode = "L" if channels == 1 else "RGB"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as opened:
                _check_integer_depth(opened)
                opened.draft(mode, (resolution, resolution))  # JPEG: decode at a reduced scale when it can
                image = ImageOps.exif_transpose(opened)
                image.load()  # decode now: a truncated file fails here
                image = ImageOps.fit(_flatten(image, mode), (resolution, resolution), method=Image.Resampling.BICUBIC)
                array = np.asarray(image, dtype=np.uint8)
    except UnidentifiedImageError:
        raise BadImage("not an image (unrecognised format)") from None
    except (BadImage, MemoryError):
        raise
    except Exception as exc:  # a corrupt file makes PIL's plugins raise anything (a TIFF's text offset: TypeError)
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise BadImage(f"cannot decode: {reason}") from None
    return array[None] if channels == 1 else array.transpose(2, 0, 1)


def dense_array(value: Any) -> np.ndarray:
    """A decoded tensor as one array. A Parquet column of nested lists (`list<list<list<uint8>>>`, Hugging Face's
    `Array3D`) reaches a batch as an object array of object arrays, one level per list."""
    array = np.asarray(value)
    if array.dtype != object:
        return array
    if array.ndim == 0 or not len(array):
        raise BadImage("an empty or null tensor: expected an image")
    try:
        return np.stack([dense_array(row) for row in array])
    except BadImage:
        raise
    except ValueError:  # rows of different lengths
        raise BadImage("a tensor whose rows differ in length: expected an image") from None


def fit_array(array: np.ndarray, resolution: int, channels: int) -> np.ndarray:
    """An already decoded uint8 image, (C, H, W) or (H, W, C) or (H, W) -> uint8 (C, R, R), resized and cropped
    like an encoded one (a no-op when it already has that shape)."""
    if array.dtype != np.uint8:
        raise BadImage(f"tensor of dtype {array.dtype}: expected uint8")
    if array.shape == (channels, resolution, resolution):
        return array
    if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[2] not in (1, 3, 4):
        array = array.transpose(1, 2, 0)  # CHW -> HWC for PIL
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise BadImage(f"tensor of shape {array.shape}: expected an image (H, W), (H, W, C) or (C, H, W)")
    image = Image.fromarray(np.ascontiguousarray(array))
    fitted = ImageOps.fit(_flatten(image, "L" if channels == 1 else "RGB"), (resolution, resolution),
                          method=Image.Resampling.BICUBIC)
    result = np.asarray(fitted, dtype=np.uint8)
    return result[None] if channels == 1 else result.transpose(2, 0, 1)
