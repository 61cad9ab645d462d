"""The model: identities and fingerprints, the record document and its strict codec,
errors, views, and the pure state machine. Imports nothing else of the package.
"""
