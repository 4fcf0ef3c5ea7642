"""The native host's image entry points called through ctypes, in a process of their own.

tests/test_native_host_images.py runs this file: the host library links the Unity plugin's ONNX Runtime, and a test
process has loaded the onnxruntime wheel's (two libonnxruntime.so.1 do not load in one process). Prints one JSON
object.

    python native_image_abi.py LIBRARY bad-input VLM_PACK TEXT_PACK
    python native_image_abi.py LIBRARY submit VLM_PACK EXTENSIONS IMAGE.rgb WIDTH HEIGHT PROMPT MAX_NEW_TOKENS
"""

from __future__ import annotations

import ctypes
import json
import sys

from pipeshard.peers import HOST_TOKEN_CALLBACK, HostOptions, HostSampling


class Image(ctypes.Structure):
    """pipeshard_image."""

    _fields_ = [("rgb", ctypes.c_void_p), ("width", ctypes.c_int), ("height", ctypes.c_int)]


def library_at(path: str) -> ctypes.CDLL:
    library = ctypes.CDLL(path)
    library.pipeshard_last_error.restype = ctypes.c_char_p
    images, sampling = ctypes.POINTER(Image), ctypes.POINTER(HostSampling)
    common = [ctypes.c_void_p, ctypes.c_char_p, images, ctypes.c_size_t, sampling, HOST_TOKEN_CALLBACK]
    library.pipeshard_generate_with_images.argtypes = [*common, ctypes.c_void_p]
    library.pipeshard_submit_with_images.argtypes = [
        *common,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint64),
    ]
    library.pipeshard_wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
    library.pipeshard_close.argtypes = [ctypes.c_void_p]
    return library


def open_host(library: ctypes.CDLL, pack: str, extensions: str | None = None) -> ctypes.c_void_p:
    options = HostOptions()
    library.pipeshard_default_options(ctypes.byref(options))
    options.threads = 2
    options.extensions_library = extensions.encode() if extensions else None
    host = ctypes.c_void_p()
    if library.pipeshard_open(pack.encode(), ctypes.byref(options), ctypes.byref(host)) != 0:
        raise SystemExit(f"cannot open {pack}: {library.pipeshard_last_error(None).decode()}")
    return host


def bad_input(library: ctypes.CDLL, vlm_pack: str, text_pack: str) -> list[dict]:
    """Each bad request's status and message."""
    pixels = (ctypes.c_uint8 * (5 * 4 * 3))()
    address = ctypes.addressof(pixels)
    good = Image(address, 5, 4)
    vlm, text = open_host(library, vlm_pack), open_host(library, text_pack)
    cases = [
        (vlm, "Hi", (Image * 1)(Image(None, 5, 4)), 1),
        (vlm, "Hi", (Image * 1)(Image(address, 0, 4)), 1),
        (vlm, "Hi", (Image * 1)(Image(address, 5, 40000)), 1),
        (vlm, "Hi", None, 2),
        (vlm, "<image> <image>", (Image * 1)(good), 1),
        (vlm, "<image> and", (Image * 2)(good, good), 2),
        (text, "Hi", (Image * 1)(good), 1),
    ]
    results = []
    for host, prompt, images, count in cases:
        status = library.pipeshard_generate_with_images(
            host, prompt.encode(), images, count, None, HOST_TOKEN_CALLBACK(), None
        )
        results.append({"status": status, "message": library.pipeshard_last_error(None).decode()})
    library.pipeshard_close(vlm)
    library.pipeshard_close(text)
    return results


def submit(
    library: ctypes.CDLL,
    pack: str,
    extensions: str,
    image: str,
    width: int,
    height: int,
    prompt: str,
    new_tokens: int,
) -> dict:
    """A queued image request whose pixel buffer is zeroed as soon as the call returns: its tokens and status."""
    with open(image, "rb") as file:
        data = file.read()
    pixels = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    host = open_host(library, pack, extensions)
    sampling = HostSampling()
    library.pipeshard_default_sampling(ctypes.byref(sampling))
    sampling.max_new_tokens = new_tokens
    tokens: list[int] = []
    collect = HOST_TOKEN_CALLBACK(lambda token, piece, user: tokens.append(int(token)) or 0)
    request = ctypes.c_uint64()
    images = (Image * 1)(Image(ctypes.addressof(pixels), width, height))
    status = library.pipeshard_submit_with_images(
        host, prompt.encode(), images, 1, ctypes.byref(sampling), collect, None, None, ctypes.byref(request)
    )
    ctypes.memset(pixels, 0, len(data))  # the host holds its own copy
    waited = library.pipeshard_wait(host, request.value, -1) if status == 0 else status
    message = library.pipeshard_last_error(None).decode()
    library.pipeshard_close(host)
    return {"submitted": status, "status": waited, "message": message, "tokens": tokens}


def main(arguments: list[str]) -> None:
    library = library_at(arguments[0])
    if arguments[1] == "bad-input":
        result = bad_input(library, arguments[2], arguments[3])
    else:
        pack, extensions, image, width, height, prompt, new_tokens = arguments[2:9]
        result = submit(library, pack, extensions, image, int(width), int(height), prompt, int(new_tokens))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
