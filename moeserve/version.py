"""The package version, in its own module so that anything can name it without importing the package's API."""
__version__ = "0.1.0"
