"""Sphinx configuration: the API reference, built from the docstrings (numpydoc style)."""

project = "polynorm"
author = "the polynorm developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = False
napoleon_numpy_docstring = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
# optional array libraries are documented without being installed
autodoc_mock_imports = ["cupy"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
nitpicky = False
