"""Helpers shared by the test tiers (one place; no test imports another test module)."""
