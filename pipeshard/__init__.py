"""pipeshard: run language models larger than VRAM by cutting them into sub-layers and planning per tier."""

__version__ = "0.1.0"


def load(path, threads=None, verify=False):
    """Load an export folder or model pack; see `pipeshard.api.load`."""
    from pipeshard.api import load as _load

    return _load(path, threads=threads, verify=verify)
