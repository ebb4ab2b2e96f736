"""Readers and writers of model files, one module per format."""
