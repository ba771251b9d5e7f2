"""The core every layer stands on: settings, database, errors, manifests, kinds."""
