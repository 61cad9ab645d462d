"""The journal: its operations over one store (``journal``), the checks of arguments,
turn-taking per identity, the runner and the steps it runs, the claim block, listing and
maintenance, reconciliation, and what it logs and counts. Stands on the model and the
store seam; the homes and the operator tools stand on it.
"""
