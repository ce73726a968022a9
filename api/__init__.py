"""The storyjobs HTTP api: ``python -m api``."""
