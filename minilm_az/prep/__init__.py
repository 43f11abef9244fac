"""Preparing a corpus: readers for raw dumps (readers.py), cleaning (clean.py) and its dedup index (dedup.py)."""
