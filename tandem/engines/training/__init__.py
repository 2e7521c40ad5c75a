"""Training engine adapters (satisfy tandem.core.protocols.TrainingEngine)."""
