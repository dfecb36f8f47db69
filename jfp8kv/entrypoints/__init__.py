"""Command-line entry points, kept out of the package root so that no module shadows a
public name (``jfp8kv.generate`` is the function). Run them as ``python -m jfp8kv COMMAND``.
"""
