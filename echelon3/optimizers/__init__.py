"""Optimizers echelon3 adds to torch's."""
