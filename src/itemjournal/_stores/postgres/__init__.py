"""The PostgreSQL store: one schema, an owner session that vouches for claims on every
host.
"""
