"""trims: a FaaS inference runtime in which function instances share one copy of each model."""

__version__ = "0.1.0"
