"""The storyjobs sweeper: ``python -m sweeper``."""
