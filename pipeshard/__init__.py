"""pipeshard: run language models larger than VRAM by cutting them into sub-layers and planning per tier."""

__version__ = "0.1.0"


def load(path, **options):
    """Load an export folder or model pack; see `pipeshard.api.load` for the options."""
    from pipeshard.api import load as _load

    return _load(path, **options)
