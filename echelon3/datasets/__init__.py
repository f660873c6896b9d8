"""Built-in datasets for the examples."""
