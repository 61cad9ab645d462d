"""The MCP home: tools of an MCP server made effect-once (``itemjournal.mcp``)."""
