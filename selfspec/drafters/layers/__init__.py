"""Drafters that run the model's own layers: early exit, static layer skip, SWIFT, CLaSp, ConfLayers, Saguaro, expert subsets."""
