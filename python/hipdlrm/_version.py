"""hipdlrm's version, written here only: pyproject.toml (the dynamic version) and hipdlrm.__version__ read it."""
__version__ = "0.1.0"
