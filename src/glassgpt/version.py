"""glassgpt's version, in a module of its own so that anything may import it without the package's API."""

__version__ = "0.1.0"
