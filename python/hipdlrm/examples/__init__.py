"""Runnable examples built on hipdlrm's operators.

``python -m hipdlrm.examples.train`` trains a DLRM or an HSTU sequential recommender on synthetic data,
optionally side by side with the same model built from plain PyTorch parts (docs/training.md).
"""
