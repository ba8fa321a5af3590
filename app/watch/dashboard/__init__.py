"""The live dashboard of ``streamrft dashboard``: a run's events folded into a page."""
