# Sphinx configuration of the Python reference (docs/CMakeLists.txt runs it with the
# package built in build/python on PYTHONPATH; `cmake --build build --target docs`).
project = "lockstep"
author = "the lockstep authors"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# The docstrings are Google style ("Args:", "Returns:", "Raises:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
nitpicky = False
html_theme = "alabaster"
html_static_path = []
templates_path = []
exclude_patterns = []
