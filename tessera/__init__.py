"""Leaf modules shared by trainer/ and models/: they import nothing from either (errors, safe tensor loading)."""
