"""moedoctor: find, explain and fix collective deadlocks in distributed PyTorch jobs."""

__version__ = "0.1.0"
