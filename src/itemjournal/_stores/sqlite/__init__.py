"""The SQLite store: one database, a writer that commits many operations at once."""
