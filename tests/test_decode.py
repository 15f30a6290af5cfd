"""The loader path's image decoding: JPEGs decoded at a reduced scale when the crop is
downsampled anyway, with the same draws and, within interpolation tolerance, the same
pixels as a full decode followed by torchvision's antialiased resize."""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
import torch
from PIL import Image

from ddpcli.data.augment import crop_box_one, resized_crop_one
from ddpcli.data.decode import (
    EncodedImage,
    UnreadableImage,
    dct_reduction,
    libjpeg_decoder,
    read_resized_crop,
    read_rgb,
    read_rgb_at_least,
    straight_jpeg_size,
)
from ddpcli.data.layout import resize_side
from ddpcli.data.sets import centre_view


def photo(seed: int, width: int = 500, height: int = 375) -> Image.Image:
    """Smooth colour waves with grain: ImageNet-sized, and not flat enough to hide errors."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / 50.0
    waves = [np.sin(x * rng.uniform(0.5, 2) + rng.uniform(0, 6)) + np.cos(y * rng.uniform(0.5, 2))
             for _ in range(3)]  # fmt: skip
    pixels = np.stack(waves, -1)
    pixels = (pixels - pixels.min()) / np.ptp(pixels) * 255 + rng.normal(0, 8, pixels.shape)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos")
    paths = {}
    for seed in range(2):
        image = photo(seed)
        image.save(folder / f"{seed}.jpg", quality=90)
        image.save(folder / f"{seed}.png")
        paths[seed] = (folder / f"{seed}.jpg", folder / f"{seed}.png")
    return paths


def full_decode_crop(path, index: int, epoch: int, size: int) -> torch.Tensor:
    """The path before: every pixel decoded, the box cut, torchvision's uint8 resize."""
    return resized_crop_one(read_rgb(path), index, 0, epoch, size)


@pytest.mark.parametrize("size", [16, 32, 112])
def test_reduced_jpeg_crops_match_a_full_decode(photos, size):
    for index, (jpeg, _) in photos.items():
        for epoch in range(4):
            box_for = functools.partial(crop_box_one, index, 0, epoch)
            got = read_resized_crop(jpeg, box_for, size)
            want = full_decode_crop(jpeg, index, epoch, size)
            assert got.dtype == torch.uint8 and got.shape == (3, size, size)
            difference = (got.float() - want.float()).abs()
            assert difference.mean() < 1.5 and difference.max() <= 16, (index, epoch)
            mirrored = (got.flip(2).float() - want.float()).abs().mean()
            assert mirrored > 3 * difference.mean()  # the same flip drawn, the same box


@pytest.mark.parametrize(
    ("height", "width", "size", "reduction"),
    [
        (375, 500, 224, 1),  # most 224 px crops of an ImageNet-sized photo: no scale keeps 224
        (447, 900, 224, 1),  # one side short of 2 x 224
        (448, 460, 224, 2),
        (300, 280, 64, 4),
        (511, 600, 64, 4),
        (512, 600, 64, 8),  # 1/8 is libjpeg's smallest
        (1000, 900, 32, 8),
        (16, 16, 32, 1),  # smaller than the output: upsampled from every pixel
    ],
)
def test_the_dct_reduction_is_the_largest_that_keeps_the_output_size(
    height, width, size, reduction
):
    assert dct_reduction(height, width, size) == reduction


def test_a_reduced_decode_never_falls_below_the_output_size(photos, monkeypatch):
    """Every crop is resized down (antialiased) from at least SIZE x SIZE decoded pixels, and
    the JPEG was decoded at the reduction the box allows."""
    jpeg, _ = photos[0]
    resizes = []
    original_resize = Image.Image.resize

    def recording_resize(self, size, resample=None, box=None, **kwargs):
        resizes.append((self.size, box))
        return original_resize(self, size, resample, box, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", recording_resize)
    reductions = set()
    for size in (16, 32, 64, 112):
        for epoch in range(6):
            box = crop_box_one(0, 0, epoch, 375, 500)
            reduction = dct_reduction(box.height, box.width, size)
            reductions.add(reduction)
            resizes.clear()
            read_resized_crop(jpeg, functools.partial(crop_box_one, 0, 0, epoch), size)
            if reduction == 1:
                continue  # libjpeg-turbo decoded it whole, torch resized it
            [(decoded, (left, top, right, bottom))] = resizes
            assert decoded == (-(-500 // reduction), -(-375 // reduction)), (size, epoch)
            assert min(right - left, bottom - top) >= size, (size, epoch)
    assert reductions == {1, 2, 4, 8}


def test_the_header_read_without_pil_gives_the_stored_size(photos, tmp_path):
    """The size a box is drawn from comes from the JPEG's frame header where libjpeg-turbo
    decodes the file straight into a tensor: the size PIL reads, so the same boxes."""
    if libjpeg_decoder() is None:
        pytest.skip("this torchvision no longer decodes JPEGs: PIL reads every size")
    jpeg, png = photos[0]
    image = Image.open(jpeg)
    exif = Image.Exif()
    exif[0x0112] = 6  # an orientation, as a camera writes it: neither PIL nor libjpeg turns
    straight = {
        "baseline": {"quality": 90},
        "progressive": {"progressive": True},
        "with EXIF": {"exif": exif.tobytes()},
        "4:4:4": {"subsampling": 0},
    }
    for name, options in straight.items():
        encoded = io.BytesIO()
        image.save(encoded, "JPEG", **options)
        assert straight_jpeg_size(encoded.getvalue()) == (375, 500), name
    for mode in ("L", "CMYK"):  # PIL converts these as ImageFolder does
        encoded = io.BytesIO()
        image.convert(mode).save(encoded, "JPEG")
        assert straight_jpeg_size(encoded.getvalue()) is None, mode
    data = jpeg.read_bytes()
    for other in (png.read_bytes(), data[:100], b"\xff\xd8\xff", b""):
        assert straight_jpeg_size(other) is None


def test_a_full_scale_jpeg_crop_never_opens_pil(photos, monkeypatch):
    """224 px crops of an ImageNet-sized JPEG leave no reduced scale: the size is read from the
    JPEG's markers and libjpeg-turbo decodes it into a tensor, PIL never opening the file
    (that cost about a tenth of the image's time), with torchvision's pixels to the last bit;
    the batch gets contiguous images (stacked many times faster than interleaved)."""
    if libjpeg_decoder() is None:
        pytest.skip("this torchvision no longer decodes JPEGs: PIL does (the same pixels)")
    jpeg, _ = photos[0]
    wants = {epoch: full_decode_crop(jpeg, 0, epoch, 224) for epoch in range(3)}
    want_view = centre_view(read_rgb(jpeg), 224)

    def no_pil(*args, **kwargs):
        raise AssertionError("PIL opened the file")

    monkeypatch.setattr(Image, "open", no_pil)
    for epoch, want in wants.items():
        got = read_resized_crop(jpeg, functools.partial(crop_box_one, 0, 0, epoch), 224)
        assert torch.equal(got, want) and got.is_contiguous(), epoch
    assert torch.equal(centre_view(read_rgb_at_least(jpeg, resize_side(224)), 224), want_view)


def test_png_crops_match_torchvision_within_rounding(photos):
    _, png = photos[1]
    for epoch in range(4):
        got = read_resized_crop(png, functools.partial(crop_box_one, 1, 0, epoch), 24)
        want = full_decode_crop(png, 1, epoch, 24)
        assert (got.float() - want.float()).abs().mean() < 0.5


def test_validation_view_of_a_reduced_jpeg(photos):
    jpeg, png = photos[0]
    side = resize_side(32)
    reduced = read_rgb_at_least(jpeg, side)
    assert min(reduced.shape[-2:]) >= side and reduced.shape[-1] < 500  # decoded smaller
    got, want = centre_view(reduced, 32).float(), centre_view(read_rgb(jpeg), 32).float()
    assert (got - want).abs().mean() < 2.5
    assert torch.equal(
        centre_view(read_rgb_at_least(png, side), 32), centre_view(read_rgb(png), 32)
    )


def test_an_unreadable_file_is_named(tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(UnreadableImage, match="broken.jpg") as error:
        read_resized_crop(bad, functools.partial(crop_box_one, 0, 0, 0), 16)
    assert error.value.exit_code == 2


def test_the_box_is_drawn_from_the_stored_size_at_every_scale(photos):
    """Seeds mean the same crops whichever way the JPEG decodes: the box is drawn from the
    size stored in the file, never from a reduced decode's."""
    jpeg, _ = photos[1]
    for size in (16, 64, 224):
        asked = []

        def box_for(height, width, asked=asked):
            asked.append((height, width))
            return crop_box_one(1, 0, 0, height, width)

        read_resized_crop(jpeg, box_for, size)
        assert asked == [(375, 500)], size


class NamedBytes(io.BytesIO):
    """A file object that names itself, as a shard's member does."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__(data)
        self.member_name = name

    def __str__(self) -> str:
        return self.member_name


def test_bytes_from_a_shard_decode_as_the_file_does_and_are_named(photos):
    """A shard's member, as bytes or as a file object, decodes to the file's pixels; a bad
    one is named as `shard:key`."""
    jpeg, _ = photos[0]
    data, name = jpeg.read_bytes(), "train-000000.tar:00007"
    box_for = functools.partial(crop_box_one, 7, 0, 0)
    for size in (32, 224):
        want = read_resized_crop(jpeg, box_for, size)
        assert torch.equal(read_resized_crop(EncodedImage(name, data), box_for, size), want)
        assert torch.equal(read_resized_crop(NamedBytes(data, name), box_for, size), want)
    for truncated in (EncodedImage(name, data[:20_000]), NamedBytes(data[:20_000], name)):
        with pytest.raises(UnreadableImage, match=r"train-000000\.tar:00007: .*truncated") as error:
            read_resized_crop(truncated, box_for, 224)
        assert error.value.exit_code == 2
