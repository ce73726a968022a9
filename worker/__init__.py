"""The storyjobs worker: ``python -m worker``."""
