"""The journal: its operations over one store, the claim block, turn-taking per identity,
and what it logs and counts. Stands on the model and the store seam.
"""
