"""The package version (one place: ``mpscope.__version__`` and ``run.meta["mpscope_version"]``)."""

__version__ = "0.1.0"
