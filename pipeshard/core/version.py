"""The one version number, written into every file pipeshard makes."""

__version__ = "0.1.0"
