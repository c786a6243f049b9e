"""Read-only views of OCI bundles."""
