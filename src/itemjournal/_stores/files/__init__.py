"""The file store: one JSON document per record, durable saves, locks, scans."""
