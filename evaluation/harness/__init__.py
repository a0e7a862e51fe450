"""Model evaluation harness: manifests, datasets, accuracy, LoadGen scenarios, systems under test.

Modules: ``manifest`` (the typed evaluation manifest), ``datasets`` (labelled samples by name),
``accuracy`` (metrics), ``prepare`` (models trained or built here, by seed), ``cli``
(``trims evaluate``). Nothing heavy is imported here.
"""
