"""`edgepfl` subcommands beside a run: audit-privacy, conformance and export."""
