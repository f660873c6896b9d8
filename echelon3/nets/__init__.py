"""Built-in networks for the examples."""
