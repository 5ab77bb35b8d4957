"""braid's version: the one place it is written. pyproject.toml reads it for the package's metadata
(`[tool.setuptools.dynamic]`), `braid.__version__` and `braid --version` print it. No imports here:
the build reads this file without importing braid (or torch)."""
__version__ = "0.2.0"
