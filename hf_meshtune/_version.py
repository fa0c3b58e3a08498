"""The package version (pyproject.toml's, kept equal by tests/test_layout.py)."""

__version__ = "0.1.0"
