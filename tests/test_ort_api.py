"""The OrtApi table indices runtime/capi.py calls through, checked against ONNX Runtime's own header."""

import pytest
from ort_header import HEADER, ort_api_members

from pipeshard.runtime import capi


@pytest.fixture(scope="module")
def members() -> list[str]:
    if not HEADER.is_file():
        pytest.fail(f"{HEADER} is missing: `make install` fetches it (tests/ort_header.py)")
    return ort_api_members(HEADER.read_text())


def test_the_header_parses_into_the_whole_table(members):
    assert members[:3] == ["CreateStatus", "GetErrorCode", "GetErrorMessage"]
    assert len(members) > 300 and len(set(members)) == len(members)


def wrong_indices(signatures: dict, members: list[str]) -> dict[str, tuple[int, int | None]]:
    """OrtApi name: (index used, index in the header), for every name whose index is not the header's."""
    return {
        name: (index, members.index(name) if name in members else None)
        for name, (index, _, _) in signatures.items()
        if index >= len(members) or members[index] != name
    }


def test_every_index_capi_calls_is_the_headers(members):
    assert not wrong_indices(capi._SIGNATURES, members)


def test_an_index_off_by_one_is_caught(members):
    index, arguments, result = capi._SIGNATURES["SessionOptionsAppendExecutionProvider_CUDA_V2"]
    shifted = {
        **capi._SIGNATURES,
        "SessionOptionsAppendExecutionProvider_CUDA_V2": (index + 1, arguments, result),
    }
    assert wrong_indices(shifted, members) == {
        "SessionOptionsAppendExecutionProvider_CUDA_V2": (index + 1, index)
    }
