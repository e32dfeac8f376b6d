"""Turning a model reference (default, local folder, GGUF file, Hub id) into a loaded model."""
