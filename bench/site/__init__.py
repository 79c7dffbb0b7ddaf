"""`python -m bench site`: every published table, measured and predicted, as one static page.

data.py gathers the cells (one record per cell and run, with every column kept for the detail view);
page.py writes site/index.html: the data embedded as JSON, the page's script and style inlined, and
the leaderboard tables rendered in HTML so the page stays readable without JavaScript. Nothing is
fetched when the page is viewed. Generated, never edited by hand.
"""

from .page import write_site

__all__ = ["write_site"]
