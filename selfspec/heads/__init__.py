"""Trained draft heads and their file format: the feature head, the pruned draft head, the exit adapter and the context head."""
