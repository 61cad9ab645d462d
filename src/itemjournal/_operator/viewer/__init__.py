"""The read-only web viewer."""
