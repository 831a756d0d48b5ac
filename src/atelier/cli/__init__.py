"""The `atelier` command line. Kept import-free so `atelier --help` stays fast."""
