"""Inference engine adapters (satisfy tandem.core.protocols.InferenceEngine)."""
