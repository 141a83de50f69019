"""The in-process recorder: torch-dependent, loaded inside every rank of a job run by moedoctor.

``install()`` registers Python kernels for the collective ops at the dispatcher and the evidence
hooks; nothing here runs in the analyzer.
"""

from moedoctor.recorder.install import install, installed_recorder

__all__ = ["install", "installed_recorder"]
