"""Configuration: YAML composition and overrides, triples to objects, argument and section
checks, the pre-flight, the arithmetic language, and the errors a user can cause."""
