"""Command-line faces: `cpn` (server side) and `cpnctl` (client, HTTP only)."""
