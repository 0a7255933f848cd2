"""embcore's version (checkpoint manifests record it)."""

__version__ = "0.1.0"
