"""The release of zerolayer (one place; pyproject.toml's version, the image tag and ``--version`` agree)."""

__version__ = "0.1.0"
