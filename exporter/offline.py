"""Nothing in pipeshard may reach the Hugging Face hub: set the offline switches before any import."""

import os


def force_offline() -> None:
    """Make huggingface_hub and transformers refuse network access."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[variable] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
