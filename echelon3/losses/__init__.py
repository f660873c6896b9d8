"""Losses a config names by module path (``echelon3.losses.sequence``)."""
