"""Sphinx configuration of the rlhf_torchrl documentation.

Build (CI runs this, warnings as errors):

    pip install -e ".[docs]"
    python -m sphinx -W --keep-going -n -b html docs docs/_build/html
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # the package, when it is not installed

import rlhf_torchrl  # noqa: E402

project = "rlhf_torchrl"
author = "rlhf_torchrl contributors"
copyright = "rlhf_torchrl contributors"
release = version = rlhf_torchrl.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "api_refs",  # docs/_ext: references checked against the code, napoleon kept off prose comments
    "api_signatures",  # docs/_ext: a class's own constructor, no private bases
    "generated_pages",  # docs/_ext: the configuration and keys references, written from the code
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
# _generated/*.md are included by the pages, never pages of their own
exclude_patterns += ["_generated"]

# settings, commands and file names appear in prose: keep "--", quotes and "..." as written
smartquotes = False

# --- MyST: links between pages and to headings are checked (a broken one is a warning, -W an error)
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]
myst_links_external_new_tab = False

# --- autodoc: the API reference from the docstrings (Google style, reST markup inside)
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
# every parameter listed with its type under "Parameters" (described or not); signatures longer
# than the page get one parameter a line
autodoc_typehints = "description"
autodoc_typehints_description_target = "all"
python_maximum_signature_line_length = 88
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# --- nitpicky (-n): every reference must resolve. The third-party types autodoc meets in signatures
# cannot resolve without intersphinx (no network in CI), so they are named here.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|tensordict|torchrl|transformers|omegaconf|hydra|numpy|ray|vllm|peft)(\..*)?"),
    # torchrl's TrainerHookBase.register, inherited by the hooks, annotates ``trainer: "Trainer"``
    (r"py:class", r"Trainer"),
]

# --- HTML: the version and the repository in the sidebar, code that fits the page
# the repository's address: set RLHF_TORCHRL_REPOSITORY to build the site for a fork
REPOSITORY = os.environ.get("RLHF_TORCHRL_REPOSITORY", "https://github.com/rlhf-torchrl/rlhf_torchrl")
html_theme = "furo"
html_title = f"rlhf_torchrl {version}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "source_repository": REPOSITORY,
    "source_branch": "main",
    "source_directory": "docs/",
}
html_sidebars = {"**": ["sidebar/brand.html", "sidebar/search.html", "sidebar/scroll-start.html",
                        "sidebar/navigation.html", "sidebar-links.html", "sidebar/scroll-end.html"]}
templates_path = ["_templates"]
html_context = {"repository": REPOSITORY, "release": release}
