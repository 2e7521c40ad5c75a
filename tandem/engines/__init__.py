"""Training and inference engine adapters; each imports its engine lazily."""
