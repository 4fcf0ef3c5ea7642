import pytest

from pipeshard.core.errors import UserError
from pipeshard.core.units import format_bytes, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GiB", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("0", 0),
        ("8 gib", 8 * 1024**3),
    ],
)
def test_parse_size_accepts_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["2XB", "", "GiB", "-1GiB", "1e9"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(UserError, match="cannot read size"):
        parse_size(text)


def test_format_bytes_says_its_unit():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 1024**2) == "3.0 MiB"
    assert format_bytes(5 * 1024**3) == "5.0 GiB"
