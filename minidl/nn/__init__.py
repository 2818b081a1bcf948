"""Cells, layers, losses and optimizers."""
