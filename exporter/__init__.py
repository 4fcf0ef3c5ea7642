"""Export a model (Hugging Face folder, GGUF file, built-in name or tiny test config) to ONNX.

Only this stage imports torch and transformers; everything downstream reads the export folder.
"""

from pipeshard.exporter.export import ExportResult, export_model

__all__ = ["ExportResult", "export_model"]
