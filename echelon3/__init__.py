"""echelon3: config-driven PyTorch training whose tasks are also Snakemake rules."""

__version__ = "0.5.0"
