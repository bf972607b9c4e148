"""unisched: one weight per tenant over every GPU engine it uses."""

__version__ = "0.1.0"
