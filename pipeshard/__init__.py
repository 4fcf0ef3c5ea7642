"""pipeshard: run language models larger than VRAM by cutting them into sub-layers and planning per tier."""

from pipeshard.core.version import __version__ as __version__


def load(path, **options):
    """Load an export folder or model pack; see `pipeshard.api.load` for the options."""
    from pipeshard.api import load as _load

    return _load(path, **options)


def use_process_thread_pool(threads=None):
    """One spinning thread pool for every ONNX Runtime session this process makes through the Python binding
    (the planned runtime's; the CPU engines have their own in runtime/capi.py). See
    `pipeshard.runtime.ort.use_process_thread_pool` for what it asks of other sessions."""
    from pipeshard.runtime.ort import use_process_thread_pool as _use

    return _use(threads)
