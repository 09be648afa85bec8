"""Optimizer state by parameter name in one safetensors file: the document (``document``), the streaming
writer (``writer``) and the range reader (``reader``)."""
