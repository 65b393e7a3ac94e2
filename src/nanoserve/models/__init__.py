"""The decoder family, its config, and the loaders that fill it with weights."""
