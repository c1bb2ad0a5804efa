"""Serving-engine integrations, one subpackage or module per engine.

Nothing in ``zkv`` imports this package; an engine's own package is imported only here.
"""
