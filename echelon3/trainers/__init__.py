"""Training loops. ``baseline.Trainer`` is the default."""
