"""The model: identities and fingerprints, the record and its rules, the strict codec,
errors, views, verdicts, and the pure state machine. Imports nothing else of the package.
"""
