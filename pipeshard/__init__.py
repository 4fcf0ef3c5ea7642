"""pipeshard: run language models larger than VRAM by cutting them into sub-layers and planning per tier."""

__version__ = "0.1.0"
