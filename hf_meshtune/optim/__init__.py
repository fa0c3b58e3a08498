"""Optimizers: ``SpectralAdamW``, AdamW on a gradient filtered through the anchor's spectrum."""

from .spectral import SpectralAdamW

__all__ = ["SpectralAdamW"]
